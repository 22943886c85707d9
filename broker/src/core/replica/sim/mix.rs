//! What a replica simulation's world may do besides the usual faults, picked by the seed.

/// What the world may do besides the usual faults.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mix {
    pub racing: bool,
    pub partitions: bool,
    pub idle: bool,
    pub crashy: bool,
    pub eager: bool,
    pub replace: bool,
}

impl Mix {
    /// The positive run covers every mix the twins use: bits of the seed pick it (one seed
    /// in four is idle, one in two crashy, one in two with an eager placement).
    pub(super) fn of_seed(seed: u64) -> Mix {
        Mix {
            racing: seed & 1 == 1,
            partitions: seed & 2 == 2,
            idle: seed & 12 == 12,
            crashy: seed & 16 == 16,
            eager: seed & 32 == 32,
            replace: seed & 64 == 64,
        }
    }
}
