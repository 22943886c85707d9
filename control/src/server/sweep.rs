//! The leader's sweep: turns time into commands for the deterministic state machine (broker
//! liveness, delete completion), so the catalog itself never reads a clock.

use super::*;

// ------------------------------------------------------------------ sweep

/// The leader's periodic decisions. Returns when `stop` fires.
pub async fn sweep(st: Arc<AppState>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let period = Duration::from_millis(st.cfg.sweep_interval_ms.max(10));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        rest_auth::keep_admin_token_file(&st);
        for cmd in sweep_once(&st) {
            let node = match &cmd {
                Command::ReplaceReplicas { node_id } => Some(*node_id),
                _ => None,
            };
            // Failures (lost leadership, timeouts) are retried on the next pass.
            if let (Some(node), Ok(Reply::Replaced { shards })) = (node, st.write(cmd).await) {
                if shards > 0 {
                    super::replication::REPLACEMENTS
                        .fetch_add(shards, std::sync::atomic::Ordering::Relaxed);
                    tracing::info!(
                        node,
                        shards,
                        "replaced a broker dead past --replica-replace-after-ms in its replica sets"
                    );
                }
            }
        }
    }
}

/// A sweep far later than its period means this process did not run (frozen, descheduled):
/// it could not take heartbeats, so that time is no evidence against any broker. Every
/// broker's last sight moves forward by the stall, and a real death is still seen, at most
/// `dead_after` after the control plane runs again. Without this, a control plane paused
/// past `dead_after` counted every broker dead on waking and moved every leadership
/// (tests/replication_faults.rs in felix-broker freezes it with SIGSTOP).
fn forgive_stall(soft: &mut Soft, now: Instant, period: Duration) {
    if let Some(prev) = soft.swept_at.replace(now) {
        let stall = now.duration_since(prev).saturating_sub(period * 2);
        if !stall.is_zero() {
            for seen in soft.last_seen.values_mut() {
                seen.1 = (seen.1 + stall).min(now);
            }
            for since in soft.dead_since.values_mut() {
                *since = (*since + stall).min(now);
            }
        }
    }
}

/// Rule 11: a broker counted dead for `--replica-replace-after-ms` (as this leader saw it;
/// a new leader starts the count again) is replaced in the replicated shards whose set may
/// change now. Asked only while the catalog has such a shard, so a shard waiting for its set
/// to settle costs no Raft write per sweep.
fn replacements(st: &AppState, soft: &mut Soft, brokers: &[Broker], now: Instant) -> Vec<Command> {
    soft.dead_since
        .retain(|id, _| brokers.iter().any(|b| b.node_id == *id && !b.live));
    let after_ms = st.cfg.replica_replace_after_ms;
    let mut cmds = Vec::new();
    for b in brokers.iter().filter(|b| !b.live) {
        let since = *soft.dead_since.entry(b.node_id).or_insert(now);
        if after_ms == 0 || now.duration_since(since) < Duration::from_millis(after_ms) {
            continue;
        }
        if st.read(|c| !c.replacements(b.node_id).is_empty()) {
            cmds.push(Command::ReplaceReplicas { node_id: b.node_id });
        }
    }
    cmds
}

/// One pass: which commands the clock calls for now.
fn sweep_once(st: &AppState) -> Vec<Command> {
    let status = st.store.status();
    let mut soft = st.soft.lock().unwrap_or_else(|e| e.into_inner());
    if !status.is_leader {
        *soft = Soft::default();
        return vec![];
    }
    let now = Instant::now();
    soft.leader_since.get_or_insert(now);
    let period = Duration::from_millis(st.cfg.sweep_interval_ms.max(10));
    forgive_stall(&mut soft, now, period);
    let mut cmds = Vec::new();
    let dead_after = Duration::from_millis(st.cfg.dead_after_ms);
    let grace = Duration::from_millis(st.cfg.delete_grace_ms);
    let (initialized, held, brokers, deleting) = st.read(|c| {
        let brokers: Vec<Broker> = c.brokers().cloned().collect();
        let mut del = Vec::new();
        for s in c
            .all_streams()
            .filter(|s| s.state == ResourceState::Deleting)
        {
            del.push((
                false,
                s.tenant.clone(),
                s.namespace.clone(),
                s.name.clone(),
                s.revision,
            ));
        }
        for s in c
            .all_caches()
            .filter(|s| s.state == ResourceState::Deleting)
        {
            del.push((
                true,
                s.tenant.clone(),
                s.namespace.clone(),
                s.name.clone(),
                s.revision,
            ));
        }
        (c.initialized(), c.placement_held(), brokers, del)
    });
    if let Some(cmd) = rest_auth::bootstrap(st).filter(|_| initialized) {
        cmds.push(cmd);
    }
    if !initialized {
        cmds.push(Command::Init {
            catalog_id: format!(
                "{:016x}{:016x}",
                rand::random::<u64>(),
                rand::random::<u64>()
            ),
            hold_placement: st.cfg.placement_settle_ms > 0,
        });
        return cmds;
    }
    // The settle window runs from the first broker this leader sees registered (a cluster
    // whose control plane starts long before its brokers still spreads them).
    if held && !brokers.is_empty() {
        let first = *soft.first_broker.get_or_insert(now);
        if now.duration_since(first) >= Duration::from_millis(st.cfg.placement_settle_ms) {
            cmds.push(Command::ReleasePlacement);
        }
    }
    for b in brokers.iter().filter(|b| b.live) {
        let seen = soft
            .last_seen
            .entry(b.node_id)
            .or_insert((b.incarnation, now));
        if seen.0 != b.incarnation {
            *seen = (b.incarnation, now);
        }
        if now.duration_since(seen.1) > dead_after {
            cmds.push(Command::SetBrokerLive {
                node_id: b.node_id,
                live: false,
            });
        }
    }
    cmds.extend(replacements(st, &mut soft, &brokers, now));
    let live: Vec<u64> = brokers
        .iter()
        .filter(|b| b.live)
        .map(|b| b.node_id)
        .collect();
    soft.deleting.retain(|k, _| deleting.contains(k));
    for k in deleting {
        let first = *soft.deleting.entry(k.clone()).or_insert(now);
        let caught_up = live
            .iter()
            .all(|id| soft.reported.get(id).is_some_and(|r| *r >= k.4));
        if caught_up || now.duration_since(first) >= grace {
            let (is_cache, tenant, namespace, name, revision) = k;
            cmds.push(if is_cache {
                Command::FinishCacheDelete {
                    tenant,
                    namespace,
                    name,
                    revision,
                }
            } else {
                Command::FinishStreamDelete {
                    tenant,
                    namespace,
                    name,
                    revision,
                }
            });
        }
    }
    cmds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_of_the_sweep_itself_is_not_counted_against_brokers() {
        let t0 = Instant::now();
        let period = Duration::from_millis(50);
        let mut soft = Soft::default();
        soft.last_seen.insert(1, (1, t0));
        // The first sweep has nothing to compare with; one on time moves nothing.
        forgive_stall(&mut soft, t0, period);
        forgive_stall(&mut soft, t0 + period, period);
        assert_eq!(soft.last_seen[&1].1, t0);
        // A sweep 2 s after the last one: the broker's last sight moves by the stall (the
        // gap less two periods of ordinary lateness).
        let late = t0 + period + Duration::from_secs(2);
        forgive_stall(&mut soft, late, period);
        assert_eq!(
            soft.last_seen[&1].1,
            t0 + Duration::from_secs(2) - period * 2
        );
        // Never past now.
        soft.last_seen.insert(2, (1, late));
        forgive_stall(&mut soft, late + Duration::from_secs(5), period);
        assert!(soft.last_seen[&2].1 <= late + Duration::from_secs(5));
    }
}
