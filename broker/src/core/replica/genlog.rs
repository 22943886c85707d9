//! What the replica machine knows of its log: the generation of every record, kept as runs
//! (one per change of generation), and the end. The records themselves live in the real log
//! (`felix_storage::Log`, whose commit headers carry the same generations) or in the
//! simulator's disk; the machine only compares generations (rule 6), so its memory does not
//! grow with the log.

use std::ops::Range;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GenLog {
    /// `(first offset, generation)`, first offsets increasing; a run lasts until the next
    /// one's first offset, or `end`. Adjacent runs differ in generation.
    runs: Vec<(u64, u64)>,
    end: u64,
}

impl GenLog {
    /// A log holding one record per generation in `gens`, from offset 0.
    pub(crate) fn from_gens(gens: impl IntoIterator<Item = u64>) -> GenLog {
        let mut l = GenLog::default();
        for g in gens {
            l.push(g);
        }
        l
    }

    /// A log from its runs `(first offset, generation)`, up to `end` (what a real log's
    /// commit headers say). The first run must start at 0 and each next one later, with
    /// another generation.
    pub(crate) fn from_runs(
        runs: impl IntoIterator<Item = (u64, u64)>,
        end: u64,
    ) -> Result<GenLog, String> {
        let runs: Vec<(u64, u64)> = runs.into_iter().collect();
        let starts_at_0 = runs.first().map_or(end == 0, |r| r.0 == 0);
        let ordered = runs.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 != w[1].1);
        let inside = runs.last().is_none_or(|r| r.0 < end);
        if !(starts_at_0 && ordered && inside) {
            return Err(format!(
                "generation runs {runs:?} do not describe a log ending at {end}"
            ));
        }
        Ok(GenLog { runs, end })
    }

    /// The offset after the last record.
    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    /// The generation of the record at `offset`, which must be below [`GenLog::end`].
    pub(crate) fn gen_at(&self, offset: u64) -> u64 {
        assert!(
            offset < self.end,
            "offset {offset} past the end {}",
            self.end
        );
        let i = self.runs.partition_point(|r| r.0 <= offset);
        self.runs[i - 1].1
    }

    /// The generation of the record before `end` (0 for an empty prefix): a position's
    /// `last_gen`.
    pub(crate) fn gen_before(&self, end: u64) -> u64 {
        end.checked_sub(1).map_or(0, |p| self.gen_at(p))
    }

    /// The generations of the records in `r` (within the log).
    pub(crate) fn gens(&self, r: Range<u64>) -> Vec<u64> {
        r.map(|o| self.gen_at(o)).collect()
    }

    pub(crate) fn push(&mut self, gen: u64) {
        if self.runs.last().is_none_or(|r| r.1 != gen) {
            self.runs.push((self.end, gen));
        }
        self.end += 1;
    }

    /// Drop the records at `from` and above.
    pub(crate) fn truncate(&mut self, from: u64) {
        if from >= self.end {
            return;
        }
        let keep = self.runs.partition_point(|r| r.0 < from);
        self.runs.truncate(keep);
        self.end = from;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_answer_like_a_list_of_generations() {
        let gens = [1, 1, 2, 2, 2, 5, 1, 7];
        let mut l = GenLog::from_gens(gens);
        assert_eq!(l.end(), 8);
        for (o, g) in gens.iter().enumerate() {
            assert_eq!(l.gen_at(o as u64), *g);
        }
        assert_eq!(l.runs.len(), 5, "one run per change");
        assert_eq!(l.gens(2..6), vec![2, 2, 2, 5]);
        assert_eq!((l.gen_before(0), l.gen_before(3)), (0, 2));
        for cut in (0..=8).rev() {
            l.truncate(cut);
            assert_eq!(l, GenLog::from_gens(gens[..cut as usize].iter().copied()));
        }
        l.push(3);
        assert_eq!(l, GenLog::from_gens([3]));
        let l = GenLog::from_gens(gens);
        assert_eq!(GenLog::from_runs(l.runs.clone(), 8), Ok(l));
        assert!(GenLog::from_runs([(1, 1)], 3).is_err(), "not from 0");
        assert!(GenLog::from_runs([(0, 1), (2, 1)], 3).is_err(), "no change");
        assert!(
            GenLog::from_runs([(0, 1), (3, 2)], 3).is_err(),
            "past the end"
        );
        assert!(GenLog::from_runs([], 3).is_err(), "records without runs");
        assert_eq!(GenLog::from_runs([], 0), Ok(GenLog::default()));
    }
}
