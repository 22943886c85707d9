----------------------------- MODULE FelixShard -----------------------------
(***************************************************************************)
(* One durable Felix shard replicated by leader lease + log shipping.      *)
(* The prose version, with the reason for every rule, is                   *)
(* docs/replication-design.md; the section names in the comments below     *)
(* refer to it.  The Rust code that implements it is                      *)
(* broker/src/core/replica/ (docs/replication-design.md, "In the code").   *)
(*                                                                         *)
(* Actors: the control plane (placement: generations, leaders, replica     *)
(* reports, storage identities, replica sets) and the brokers in Nodes.    *)
(* The shard starts on the replica set InitSet; with Reconfigure,          *)
(* placement may replace one replica by a broker outside the set in a new  *)
(* generation (rule J, "Replacing a replica").  Clocks are abstract: a lease is  *)
(* a boolean that a majority exchange sets and that may lapse at any time, *)
(* "held" meaning "its holder may still act on it" (the suspension margin  *)
(* included); the new leader's wait is the precondition of BeginServe.     *)
(* Every exchange between two processes is one atomic step.                *)
(*                                                                         *)
(* The boolean constants switch single rules off.  The passing             *)
(* configurations set them all TRUE; each negative twin sets one FALSE and *)
(* must produce a counterexample (see tla/check.sh).                       *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, TLC

CONSTANTS
    Nodes,          \* the replica set of the shard
    None,           \* a model value: "no node"
    MaxGen,         \* bound: generations the control plane may issue
    MaxLen,         \* bound: a leader appends client records while its log is shorter
    MaxCrashes,     \* bound: machine crashes that lose the fsync window
    UseFence,       \* rule F: a replica refuses anything from a generation below its promise
    UseBallot,      \* rule B: a replica refuses a second leader at a generation it accepted
    AckAfterReport, \* rule R: the commit mark moves only on the leader's landed report
    CheckStorageIdentity, \* rule S: a report or assignment counts only under the storage
                          \*         identity it names
    PromoteAtCommit, \* rule P: placement promotes only a replica at or past its commit mark
    WaitOutLease,   \* rule W: a new leader waits out every lease held when its fence completed
    RacingPlacement, \* environment: placement may name a second leader at an issued generation
    CrashNamedLeader, \* environment: a lossy crash may hit the replica placement names as leader
    InitSet,        \* the replica set the shard is created on (a subset of Nodes)
    Reconfigure,    \* environment: placement may replace a replica of the set, in a new generation
    JointFence,     \* rule J: a fence completes only with a majority of the new set and of the
                    \*         settled one (the set of the newest generation whose report landed)
    SettleBeforeChange \* rule J: placement changes the set only while the newest generation
                       \*         is settled (its leader's report landed)

ASSUME /\ MaxGen \in Nat /\ MaxLen \in Nat /\ MaxCrashes \in Nat
       /\ None \notin Nodes
       /\ InitSet \subseteq Nodes /\ InitSet # {}
       /\ \A b \in {UseFence, UseBallot, AckAfterReport, CheckStorageIdentity,
                    PromoteAtCommit, WaitOutLease, RacingPlacement, CrashNamedLeader,
                    Reconfigure, JointFence, SettleBeforeChange}
              : b \in BOOLEAN

VARIABLES
    \* control plane (durable)
    cpGen,      \* the newest generation placement has issued (0: none yet)
    cpLeader,   \* the leader placement names at cpGen
    cpSid,      \* the storage identity of cpLeader the promotion was decided on
    cpCommit,   \* the commit mark the landed reports showed: [lg, off], never moved back
    rep,        \* rep[n]: the last landed report about n: [lg, off, sid]
                \*   (position = generation of the last record held, offset held)
    cpSet,      \* the replica set of generation cpGen
    cpSettled,  \* the replica set of the newest generation whose leader's report landed
    \* replicas: durable state
    log,        \* log[n]: sequence of records [g |-> generation, w |-> writing leader,
                \*   c |-> TRUE for a client record, FALSE for a generation start]
    sid,        \* sid[n]: storage identity of n's data directory (rotates on a lossy crash)
    promised,   \* promised[n]: highest generation n has promised (fence answer / own lead)
    ballot,     \* ballot[n]: the leader n accepted at promised[n] (None before any)
    lgen,       \* lgen[n]: the highest generation n has led (0: never); kept with the ballot
    \* replicas: volatile state
    role,       \* "follower" | "fencing" | "waiting" | "serving"
    fenced,     \* fenced[l]: replicas that answered l's fence at lgen[l] (l included)
    lset,       \* lset[l]: the replica set l leads at lgen[l] (from its assignment)
    lprev,      \* lprev[l]: the settled set when l took the lead (its fence covers it too)
    match,      \* match[l][f]: [ok, off, sid]: what f last answered l
    lease,      \* lease[n]: n holds a lease it may still act on
    waitfor,    \* waitfor[n]: leases n's post-fence wait must outlast
    \* bookkeeping (history, never read by the protocol)
    acked,      \* records released to clients as Quorum-acknowledged: [off, e]
    elected,    \* [g, n] for every fence that completed
    crashes     \* lossy machine crashes so far

vars == <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, promised, ballot, lgen, role, fenced,
          match, lease, waitfor, acked, elected, crashes, cpSet, cpSettled, lset, lprev>>
\* what the actions below that do not change the replica sets leave alone
sets == <<cpSet, cpSettled, lset, lprev>>

Leading == {"fencing", "waiting", "serving"}
Elected == {"waiting", "serving"}          \* fence complete
\* X holds a majority of the replica set S
QuorumOf(S, X) == 2 * Cardinality(X \cap S) > Cardinality(S)
Min(a, b) == IF a < b THEN a ELSE b
Max(S) == CHOOSE x \in S : \A y \in S : y <= x

Record == [g : 0..MaxGen, w : Nodes, c : BOOLEAN]
NoMatch == [ok |-> FALSE, off |-> 0, sid |-> 0]

\* generation of the record at offset k (0 for the empty prefix)
GenAt(s, k) == IF k = 0 THEN 0 ELSE s[k].g
\* "furthest ahead": compare the generation of the last record, then the offset
PosLeq(a, b) == a.lg < b.lg \/ (a.lg = b.lg /\ a.off <= b.off)

\* The offset up to which follower log b agrees with leader log a, as the
\* shipping handshake finds it: the highest k at which the record generations
\* agree (by LogMatching, everything below it agrees too).
CommonPrefix(a, b) ==
    LET m == Min(Len(a), Len(b))
        Agree(k) == k = 0 \/ a[k].g = b[k].g
    IN Max({k \in 0..m : Agree(k)})

\* Does replica f take a fence / batch / lease exchange from leader l at generation g?
Accepts(f, l, g) ==
    /\ UseFence => g >= promised[f]                              \* rule F
    /\ UseBallot => (g = promised[f] => ballot[f] \in {None, l}) \* rule B
\* a replica leading a generation >= g takes nothing from another leader at g
Foreign(f, g) == role[f] \in Leading /\ lgen[f] >= g

\* Rule S at the control plane: a report vouches for a replica only while the
\* storage identity it was made under is still the one the replica registered.
Vouched(n) == CheckStorageIdentity => rep[n].sid = sid[n]

Serving(n) == role[n] = "serving" /\ lease[n]

-----------------------------------------------------------------------------
Init ==
    /\ cpGen = 0
    /\ cpLeader = None
    /\ cpSid = 0
    /\ cpCommit = [lg |-> 0, off |-> 0]
    /\ rep = [n \in Nodes |-> [lg |-> 0, off |-> 0, sid |-> 0]]
    /\ cpSet = InitSet
    /\ cpSettled = InitSet
    /\ lset = [n \in Nodes |-> {}]
    /\ lprev = [n \in Nodes |-> {}]
    /\ log = [n \in Nodes |-> << >>]
    /\ sid = [n \in Nodes |-> 0]
    /\ promised = [n \in Nodes |-> 0]
    /\ ballot = [n \in Nodes |-> None]
    /\ lgen = [n \in Nodes |-> 0]
    /\ role = [n \in Nodes |-> "follower"]
    /\ fenced = [n \in Nodes |-> {}]
    /\ match = [l \in Nodes |-> [f \in Nodes |-> NoMatch]]
    /\ lease = [n \in Nodes |-> FALSE]
    /\ waitfor = [n \in Nodes |-> {}]
    /\ acked = {}
    /\ elected = {}
    /\ crashes = 0

(* Promotion (doc: "Promotion").  Placement may replace the leader at any    *)
(* time (lease lapse, the followers' word, an operator): failure detection   *)
(* is not trusted for safety.  It names a replica whose report still        *)
(* vouches for it (rule S) at or past the commit mark the landed reports    *)
(* showed (rule P); the current leader is a candidate like any other, and a  *)
(* shard with no such replica waits.  Which one of them is a liveness       *)
(* choice (the code takes the furthest ahead that is up): any may be named  *)
(* here.  The assignment names the storage identity the decision was made   *)
(* on.                                                                      *)
Eligible(c) ==
    /\ Vouched(c)
    /\ PromoteAtCommit => PosLeq(cpCommit, rep[c])

(* With Reconfigure, the new generation may also replace one replica of the *)
(* set by a broker outside it (a follower dead too long, rule J); only while *)
(* the newest generation is settled, so at most two sets are ever in play:   *)
(* the settled one and the current one.  A replaced replica keeps its files  *)
(* and may still be up: failure detection is not trusted for safety.        *)
NextSets ==
    {cpSet} \cup
    (IF Reconfigure /\ (SettleBeforeChange => cpSettled = cpSet)
       THEN {(cpSet \ {d}) \cup {a} : d \in cpSet, a \in Nodes \ cpSet}
       ELSE {})

Promote(c) ==
    /\ Eligible(c)
    /\ \E s \in NextSets :
          /\ c \in s
          /\ \E g \in {cpGen + 1} \cup (IF RacingPlacement /\ cpGen > 0 /\ c # cpLeader
                                           /\ s = cpSet
                                          THEN {cpGen} ELSE {}) :
                /\ g <= MaxGen
                /\ cpGen' = g
                /\ cpLeader' = c
                /\ cpSet' = s
    /\ cpSid' = rep[c].sid
    /\ UNCHANGED <<cpCommit, rep, log, sid, promised, ballot, lgen, role, fenced, match,
                   lease, waitfor, acked, elected, crashes, cpSettled, lset, lprev>>

(* The named replica takes the generation, if the assignment names its      *)
(* current storage identity (rule S): it writes its own ballot (a broker     *)
(* never leads a generation it accepted from another node, nor one it led    *)
(* before, e.g. before a restart) and starts fencing.  It stops acting on    *)
(* any lease it held.                                                        *)
TakeLead(c) ==
    /\ cpLeader = c
    /\ CheckStorageIdentity => sid[c] = cpSid
    /\ lgen[c] < cpGen
    /\ Accepts(c, c, cpGen)
    /\ role' = [role EXCEPT ![c] = "fencing"]
    /\ lgen' = [lgen EXCEPT ![c] = cpGen]
    /\ promised' = [promised EXCEPT ![c] = IF cpGen > @ THEN cpGen ELSE @]
    /\ ballot' = [ballot EXCEPT ![c] = IF cpGen >= promised[c] THEN c ELSE @]
    /\ fenced' = [fenced EXCEPT ![c] = {c}]
    /\ match' = [match EXCEPT ![c] = [f \in Nodes |-> NoMatch]]
    /\ lease' = [lease EXCEPT ![c] = FALSE]
    /\ waitfor' = [m \in Nodes |-> IF m = c THEN {} ELSE waitfor[m] \ {c}]
    /\ lset' = [lset EXCEPT ![c] = cpSet]
    /\ lprev' = [lprev EXCEPT ![c] = cpSettled]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, acked, elected, crashes,
                   cpSet, cpSettled>>

(* Fencing (doc: "Fencing a new generation").  f promises generation g to l  *)
(* and records l in its ballot, fsynced before the answer.  A replica that   *)
(* was leading a lower generation steps down and stops acting on its lease.  *)
Fence(l, f) ==
    /\ role[l] = "fencing"
    /\ f \in lset[l] \cup lprev[l]
    /\ f \notin fenced[l]
    /\ ~Foreign(f, lgen[l])
    /\ Accepts(f, l, lgen[l])
    /\ IF lgen[l] >= promised[f]
         THEN /\ promised' = [promised EXCEPT ![f] = lgen[l]]
              /\ ballot' = [ballot EXCEPT ![f] = l]
         ELSE UNCHANGED <<promised, ballot>>
    /\ role' = [role EXCEPT ![f] = "follower"]
    /\ lease' = [lease EXCEPT ![f] = FALSE]
    /\ match' = [match EXCEPT ![f] = [n \in Nodes |-> NoMatch]]
    /\ fenced' = [fenced EXCEPT ![l] = @ \cup {f}, ![f] = {}]
    /\ waitfor' = [n \in Nodes |-> IF n = f THEN {} ELSE waitfor[n] \ {f}]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, lgen, acked, elected, crashes,
                   sets>>

(* The fence is complete once a majority of its set (the leader included)   *)
(* answered, and (rule J) a majority of the settled set: any generation      *)
(* that may still serve leads one of the two.  From here the old generation  *)
(* cannot renew a lease or commit.  The leader appends its generation-start  *)
(* record and waits out every lease that may still be held: L + margin on   *)
(* its own monotonic clock.                                                  *)
FenceComplete(n) ==
    /\ role[n] = "fencing"
    /\ QuorumOf(lset[n], fenced[n])
    /\ JointFence => QuorumOf(lprev[n], fenced[n])
    /\ role' = [role EXCEPT ![n] = "waiting"]
    /\ waitfor' = [waitfor EXCEPT ![n] = {m \in Nodes \ {n} : lease[m]}]
    /\ elected' = elected \cup {[g |-> lgen[n], n |-> n]}
    /\ log' = [log EXCEPT ![n] = Append(@, [g |-> lgen[n], w |-> n, c |-> FALSE])]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, sid, promised, ballot, lgen, fenced,
                   match, lease, acked, crashes, sets>>

(* Bounded suspension, as the model states it: the wait is over only once    *)
(* every lease that was held when the fence completed has lapsed.  A leader  *)
(* suspended with a lease check in hand acts on it at most the margin later, *)
(* so "lapsed" includes the suspension margin.                               *)
BeginServe(n) ==
    /\ role[n] = "waiting"
    /\ WaitOutLease => waitfor[n] = {}
    /\ role' = [role EXCEPT ![n] = "serving"]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, promised, ballot, lgen, fenced,
                   match, lease, waitfor, acked, elected, crashes, sets>>

(* Leases (doc: "Generations and leases").  A leader's lease is granted by   *)
(* an exchange that a majority (itself included) answers at its generation,  *)
(* timed on the leader's monotonic clock from when it sent the exchange.     *)
Renew(l) ==
    /\ role[l] \in Leading
    /\ ~lease[l]
    /\ QuorumOf(lset[l], {l} \cup {f \in fenced[l] \ {l} : ~Foreign(f, lgen[l])
                                                            /\ Accepts(f, l, lgen[l])})
    /\ lease' = [lease EXCEPT ![l] = TRUE]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, promised, ballot, lgen, role,
                   fenced, match, waitfor, acked, elected, crashes, sets>>

LeaseLapse(n) ==
    /\ lease[n]
    /\ lease' = [lease EXCEPT ![n] = FALSE]
    /\ waitfor' = [m \in Nodes |-> waitfor[m] \ {n}]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, promised, ballot, lgen, role,
                   fenced, match, acked, elected, crashes, sets>>

(* A serving leader, inside its lease, appends a client record.              *)
Publish(l) ==
    /\ Serving(l)
    /\ Len(log[l]) < MaxLen
    /\ log' = [log EXCEPT ![l] = Append(@, [g |-> lgen[l], w |-> l, c |-> TRUE])]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, sid, promised, ballot, lgen, role, fenced,
                   match, lease, waitfor, acked, elected, crashes, sets>>

(* Shipping (doc: "Log shipping").  One exchange: the leader finds where f's *)
(* log agrees with its own (by generation at each offset), f drops its       *)
(* disagreeing suffix and appends the next records (any number, none         *)
(* included), and answers with the offset it now holds and its storage       *)
(* identity.  Only an elected leader ships.                                  *)
Ship(l, f) ==
    /\ role[l] \in Elected
    /\ f \in (fenced[l] \cap lset[l]) \ {l}
    /\ ~Foreign(f, lgen[l])
    /\ Accepts(f, l, lgen[l])
    /\ LET k == CommonPrefix(log[l], log[f])
       IN \E j \in k..Len(log[l]) :
             /\ log' = [log EXCEPT ![f] = SubSeq(@, 1, k) \o SubSeq(log[l], k + 1, j)]
             /\ match' = [match EXCEPT ![l][f] = [ok |-> TRUE, off |-> j, sid |-> sid[f]]]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, sid, promised, ballot, lgen, role, fenced,
                   lease, waitfor, acked, elected, crashes, sets>>

(* The commit mark (doc: "The commit mark").  The highest offset of the     *)
(* leader's own generation that a majority holds, by the given holders.     *)
CommitMark(l, Holders(_)) ==
    LET ks == {k \in 1..Len(log[l]) : log[l][k].g = lgen[l] /\ QuorumOf(lset[l], Holders(k))}
    IN IF ks = {} THEN 0 ELSE Max(ks)

\* the client records at or below the mark are acknowledged
Ack(l, k) == acked \cup {[off |-> j, e |-> log[l][j]] : j \in {i \in 1..k : log[l][i].c}}

(* Replica report (doc: "Replica reports").  The leader tells placement who  *)
(* holds what: itself and every follower that has answered it, each with    *)
(* the storage identity its answer came under.  Placement takes a report    *)
(* only from the leader it names at its newest generation; that generation  *)
(* is then settled (rule J).  With rule R the leader moves its commit mark, *)
(* releasing acknowledgements, when the report has landed and only on what  *)
(* the report says.                                                         *)
Report(l) ==
    /\ role[l] \in Elected
    /\ cpLeader = l
    /\ cpGen = lgen[l]
    /\ LET new == [n \in Nodes |->
                    IF n = l THEN [lg |-> GenAt(log[l], Len(log[l])), off |-> Len(log[l]),
                                   sid |-> sid[l]]
                    ELSE IF n \in lset[l] /\ match[l][n].ok
                      THEN [lg |-> GenAt(log[l], match[l][n].off), off |-> match[l][n].off,
                            sid |-> match[l][n].sid]
                      ELSE rep[n]]
           \* placement vouches for n on l's log at offset k
           H(k) == {n \in lset[l] : (CheckStorageIdentity => new[n].sid = sid[n])
                                  /\ new[n].off >= k /\ new[n].off <= Len(log[l])
                                  /\ GenAt(log[l], new[n].off) = new[n].lg}
           \* placement computes the mark from the same report as the leader
           mark == [lg |-> lgen[l], off |-> CommitMark(l, H)]
       IN /\ rep' = new
          /\ cpCommit' = IF mark.off > 0 /\ PosLeq(cpCommit, mark) THEN mark ELSE cpCommit
          /\ acked' = IF AckAfterReport /\ role[l] = "serving"
                        THEN Ack(l, CommitMark(l, H)) ELSE acked
          /\ cpSettled' = lset[l]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, log, sid, promised, ballot, lgen, role, fenced,
                   match, lease, waitfor, elected, crashes, cpSet, lset, lprev>>

(* Negative twin only (AckAfterReport = FALSE): the leader moves its commit *)
(* mark on its followers' answers, whether or not placement has the report. *)
AckOnAnswers(l) ==
    /\ ~AckAfterReport
    /\ role[l] = "serving"
    /\ LET H(k) == {l} \cup {f \in Nodes : match[l][f].ok /\ match[l][f].off >= k}
       IN acked' = Ack(l, CommitMark(l, H))
    /\ acked' # acked
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, log, sid, promised, ballot, lgen, role,
                   fenced, match, lease, waitfor, elected, crashes, sets>>

(* Storage identity (doc: "Follower crash and storage identity").  A machine *)
(* crash under a relaxed fsync mode loses an unknown suffix of the log, so  *)
(* the broker comes back under a new storage identity, registered with      *)
(* placement before it answers anyone.  The promise, ballot and led         *)
(* generation were fsynced explicitly and survive.  Volatile state is gone. *)
Crash(n) ==
    /\ crashes < MaxCrashes
    /\ CrashNamedLeader \/ n # cpLeader
    /\ crashes' = crashes + 1
    /\ \E k \in 0..Len(log[n]) : log' = [log EXCEPT ![n] = SubSeq(@, 1, k)]
    /\ sid' = [sid EXCEPT ![n] = @ + 1]
    /\ role' = [role EXCEPT ![n] = "follower"]
    /\ fenced' = [fenced EXCEPT ![n] = {}]
    /\ match' = [match EXCEPT ![n] = [f \in Nodes |-> NoMatch]]
    /\ lease' = [lease EXCEPT ![n] = FALSE]
    /\ waitfor' = [m \in Nodes |-> IF m = n THEN {} ELSE waitfor[m] \ {n}]
    /\ UNCHANGED <<cpGen, cpLeader, cpSid, cpCommit, rep, promised, ballot, lgen, acked, elected,
                   sets>>

Next ==
    \/ \E n \in Nodes :
          \/ Promote(n) \/ TakeLead(n) \/ FenceComplete(n) \/ BeginServe(n)
          \/ Renew(n) \/ LeaseLapse(n) \/ Publish(n) \/ Report(n)
          \/ AckOnAnswers(n) \/ Crash(n)
    \/ \E l, f \in Nodes : Fence(l, f) \/ Ship(l, f)

Spec == Init /\ [][Next]_vars

-----------------------------------------------------------------------------
(* Properties *)

TypeOK ==
    /\ cpGen \in 0..MaxGen
    /\ cpLeader \in Nodes \cup {None}
    /\ cpSid \in 0..MaxCrashes
    /\ cpCommit.lg \in 0..MaxGen /\ cpCommit.off \in Nat
    /\ \A n \in Nodes :
          /\ log[n] \in Seq(Record)
          /\ Len(log[n]) <= MaxGen + MaxLen
          /\ sid[n] \in 0..MaxCrashes
          /\ promised[n] \in 0..MaxGen
          /\ ballot[n] \in Nodes \cup {None}
          /\ lgen[n] \in 0..MaxGen
          /\ role[n] \in {"follower"} \cup Leading
          /\ fenced[n] \subseteq Nodes
          /\ lease[n] \in BOOLEAN
          /\ waitfor[n] \subseteq Nodes
          /\ rep[n].lg \in 0..MaxGen /\ rep[n].off \in Nat /\ rep[n].sid \in 0..MaxCrashes
          /\ lset[n] \subseteq Nodes /\ lprev[n] \subseteq Nodes
    /\ cpSet \subseteq Nodes /\ cpSettled \subseteq Nodes
    /\ Cardinality(cpSet) = Cardinality(InitSet)
    /\ crashes \in 0..MaxCrashes

(* An acknowledged Quorum record survives any promotion: every leader of    *)
(* the newest generation whose fence completed holds it at its offset.      *)
NoAckedRecordLost ==
    \A a \in acked : \A n \in Nodes :
        (role[n] \in Elected /\ lgen[n] = cpGen)
            => Len(log[n]) >= a.off /\ log[n][a.off] = a.e

(* At most one leader serves (has finished its wait and holds a lease).     *)
AtMostOneServing ==
    \A m, n \in Nodes : Serving(m) /\ Serving(n) => m = n

(* No two replicas ever complete a fence at the same generation.            *)
OneLeaderPerGeneration ==
    \A x, y \in elected : x.g = y.g => x.n = y.n

(* Two logs holding a record of the same generation at the same offset      *)
(* agree on everything up to and including it.                              *)
LogMatching ==
    \A m, n \in Nodes :
        \A k \in 1..Min(Len(log[m]), Len(log[n])) :
            log[m][k].g = log[n][k].g => SubSeq(log[m], 1, k) = SubSeq(log[n], 1, k)

-----------------------------------------------------------------------------
(* Reachability probes.  Each states that something interesting never      *)
(* happens; its configuration (FelixShardProbe*.cfg) expects TLC to find   *)
(* that it does, so a passing configuration cannot pass because an action  *)
(* became unreachable.                                                     *)

\* an acknowledged client record, then another replica serving a later generation
ProbeAckThenFailover ==
    ~\E a \in acked : \E n \in Nodes :
        a.e.c /\ a.e.w # n /\ role[n] = "serving" /\ lgen[n] > a.e.g

\* a replica lost, in a lossy crash, an acknowledged record that its landed
\* report (under its old identity) still says it holds
ProbeStaleReportAfterCrash ==
    ~\E n \in Nodes : sid[n] # rep[n].sid /\
        \E a \in acked : a.off <= rep[n].off /\ Len(log[n]) < a.off

\* two logs disagree at some offset (shipping must truncate)
ProbeDivergentLogs ==
    ~\E m, n \in Nodes : \E k \in 1..Min(Len(log[m]), Len(log[n])) : log[m][k].g # log[n][k].g

\* a broker outside the initial set serves (a replica was replaced)
ProbeReplaced ==
    ~\E n \in Nodes \ InitSet : role[n] = "serving"

\* two replicas lead (fence) the same generation at once (racing placement)
ProbeRacingLeaders ==
    ~\E m, n \in Nodes : m # n /\ role[m] \in Leading /\ role[n] \in Leading /\ lgen[m] = lgen[n]

\* symmetric in the initial replicas (a broker outside InitSet is not like them)
Perms == Permutations(InitSet)
=============================================================================
