//! What each policy should give, as formulas (SG-IOV §6.1, §A.3), for the
//! scheduler benchmark's "expected" column and the tests.
//!
//! DRF under ratio-bandwidth demand (§A.3): tenant `t` uses classes `S_t`,
//! consuming `a_t · r_tj` on class `j` for an allocation `a_t`.
//!
//! ```text
//! Z_t = min_{j∈S_t} C_j / r_tj                      (bottleneck)
//! s*  = min_j C_j / Σ_{t: j∈S_t} Z_t · r_tj          (common dominant share)
//! a_t = s* · Z_t                                     (closed form)
//! ```
//!
//! The closed form is the first step of progressive filling. When it leaves
//! capacity idle on some class (every tenant that saturated a class stops,
//! the others could still grow) or a tenant wants less (a demand cap),
//! [`progressive_fill`] keeps raising the unfrozen tenants together until
//! every tenant is frozen by a saturated class or its demand.

/// One tenant's use of the classes.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantDemand {
    /// (class index, ratio): bytes on that class per byte of allocation
    /// (1.0 everywhere = equal-bandwidth demand).
    pub uses: Vec<(usize, f64)>,
    /// The most this tenant wants (bytes/s of allocation), if limited.
    pub demand: Option<f64>,
}

impl TenantDemand {
    /// Equal-bandwidth demand on `classes`.
    pub fn equal(classes: &[usize]) -> Self {
        TenantDemand {
            uses: classes.iter().map(|&c| (c, 1.0)).collect(),
            demand: None,
        }
    }

    pub fn with_demand(mut self, d: f64) -> Self {
        self.demand = Some(d);
        self
    }
}

/// `Z_t`: the tenant's bottleneck capacity.
pub fn bottleneck(caps: &[f64], t: &TenantDemand) -> f64 {
    t.uses
        .iter()
        .map(|&(j, r)| caps[j] / r)
        .fold(f64::INFINITY, f64::min)
}

/// The paper's closed form: `(s*, a_t = s* · Z_t)`.
pub fn closed_form(caps: &[f64], tenants: &[TenantDemand]) -> (f64, Vec<f64>) {
    let z: Vec<f64> = tenants.iter().map(|t| bottleneck(caps, t)).collect();
    let s = (0..caps.len())
        .filter_map(|j| {
            let load: f64 = tenants
                .iter()
                .zip(&z)
                .flat_map(|(t, zt)| {
                    t.uses
                        .iter()
                        .filter(move |u| u.0 == j)
                        .map(move |u| zt * u.1)
                })
                .sum();
            (load > 0.0).then(|| caps[j] / load)
        })
        .fold(f64::INFINITY, f64::min);
    let s = if s.is_finite() { s } else { 0.0 };
    (s, z.iter().map(|zt| s * zt).collect())
}

/// Progressive filling with per-tenant weights: all unfrozen tenants grow
/// at rates proportional to `weights` until a class saturates (its tenants
/// freeze) or a tenant reaches its demand (it freezes).
pub fn progressive_fill(caps: &[f64], tenants: &[TenantDemand], weights: &[f64]) -> Vec<f64> {
    let n = tenants.len();
    let mut a = vec![0.0; n];
    let mut rem = caps.to_vec();
    let mut frozen: Vec<bool> = (0..n)
        .map(|t| weights[t] <= 0.0 || tenants[t].uses.is_empty())
        .collect();
    let eps = 1e-9;
    for _ in 0..=(n + caps.len()) {
        if frozen.iter().all(|f| *f) {
            break;
        }
        let load: Vec<f64> = (0..caps.len())
            .map(|j| {
                (0..n)
                    .filter(|&t| !frozen[t])
                    .flat_map(|t| {
                        tenants[t]
                            .uses
                            .iter()
                            .filter(move |u| u.0 == j)
                            .map(move |u| weights[t] * u.1)
                    })
                    .sum()
            })
            .collect();
        let mut step = f64::INFINITY;
        for j in 0..caps.len() {
            if load[j] > 0.0 {
                step = step.min(rem[j].max(0.0) / load[j]);
            }
        }
        for t in 0..n {
            if let (false, Some(d)) = (frozen[t], tenants[t].demand) {
                step = step.min(((d - a[t]) / weights[t]).max(0.0));
            }
        }
        if !step.is_finite() {
            break;
        }
        for t in 0..n {
            if !frozen[t] {
                a[t] += weights[t] * step;
            }
        }
        for j in 0..caps.len() {
            rem[j] -= load[j] * step;
        }
        for t in 0..n {
            if frozen[t] {
                continue;
            }
            let saturated = tenants[t]
                .uses
                .iter()
                .any(|&(j, _)| rem[j] <= eps * caps[j]);
            let satisfied = tenants[t].demand.is_some_and(|d| a[t] >= d * (1.0 - eps));
            if saturated || satisfied {
                frozen[t] = true;
            }
        }
    }
    a
}

/// DRF: the closed form, extended by progressive filling.
pub fn drf(caps: &[f64], tenants: &[TenantDemand]) -> Vec<f64> {
    let z: Vec<f64> = tenants.iter().map(|t| bottleneck(caps, t)).collect();
    progressive_fill(caps, tenants, &z)
}

/// Round-robin over pipes with one job per turn: every class gives its
/// backlogged pipes equal job rates, so bytes go in proportion to job size
/// (max-min fair in jobs per second).
pub fn round_robin(caps: &[f64], tenants: &[TenantDemand], job_size: &[f64]) -> Vec<f64> {
    progressive_fill(caps, tenants, job_size)
}

/// Strict priority (0 = highest): each level fills what the levels above
/// left, round-robin inside the level.
pub fn priority(caps: &[f64], tenants: &[TenantDemand], prio: &[u8], job_size: &[f64]) -> Vec<f64> {
    let mut rem = caps.to_vec();
    let mut a = vec![0.0; tenants.len()];
    let mut levels: Vec<u8> = prio.to_vec();
    levels.sort_unstable();
    levels.dedup();
    for l in levels {
        let idx: Vec<usize> = (0..tenants.len()).filter(|&t| prio[t] == l).collect();
        let ts: Vec<TenantDemand> = idx.iter().map(|&t| tenants[t].clone()).collect();
        let w: Vec<f64> = idx.iter().map(|&t| job_size[t]).collect();
        let got = progressive_fill(&rem, &ts, &w);
        for (k, &t) in idx.iter().enumerate() {
            a[t] = got[k];
            for &(j, r) in &tenants[t].uses {
                rem[j] = (rem[j] - got[k] * r).max(0.0);
            }
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{Class, NCLASSES};
    use crate::sched::{Policy, Queued, SchedConfig, Scheduler};
    use rand::{Rng, SeedableRng};

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-9)
    }

    #[test]
    fn the_papers_example() {
        // RDMA 100, crypto 60; T1 {RDMA}, T2 {RDMA, crypto}: s* = 0.625.
        let caps = [100.0, 60.0];
        let ts = [TenantDemand::equal(&[0]), TenantDemand::equal(&[0, 1])];
        let (s, a) = closed_form(&caps, &ts);
        assert!(close(s, 0.625, 1e-12));
        assert!(close(a[0], 62.5, 1e-12) && close(a[1], 37.5, 1e-12));
        assert_eq!(drf(&caps, &ts), a, "nothing left for progressive filling");
        // The issue's scenario (b): copy 400, crypto 160 gives 7:3 (5:2).
        let a = drf(&[400.0, 160.0], &ts);
        assert!(close(a[0], 400.0 * 400.0 / 560.0, 1e-9));
        assert!(close(a[0] / (a[0] + a[1]), 0.714, 1e-3));
    }

    #[test]
    fn progressive_filling_uses_what_the_closed_form_leaves() {
        // Scenario (c): T3 {crypto} joins. s* = 0.5 leaves 120 of copy idle;
        // only T1 can use it.
        let caps = [400.0, 160.0];
        let ts = [
            TenantDemand::equal(&[0]),
            TenantDemand::equal(&[0, 1]),
            TenantDemand::equal(&[1]),
        ];
        let (s, cf) = closed_form(&caps, &ts);
        assert!(close(s, 0.5, 1e-12));
        assert_eq!(cf, vec![200.0, 80.0, 80.0]);
        let a = drf(&caps, &ts);
        assert!(close(a[0], 320.0, 1e-9) && close(a[1], 80.0, 1e-9) && close(a[2], 80.0, 1e-9));
    }

    #[test]
    fn ratio_demand_and_other_policies() {
        // Ratio extension: a tenant needing 2 bytes of crypto per byte.
        let caps = [100.0, 100.0];
        let ts = [
            TenantDemand {
                uses: vec![(0, 1.0), (1, 2.0)],
                demand: None,
            },
            TenantDemand::equal(&[1]),
        ];
        let (s, a) = closed_form(&caps, &ts);
        // Z = (50, 100), s* = min(100/50, 100/(100+100)) = 0.5.
        assert!(close(s, 0.5, 1e-12) && close(a[0], 25.0, 1e-12) && close(a[1], 50.0, 1e-12));
        // RR on one engine: bytes in proportion to job sizes.
        let one = [TenantDemand::equal(&[0]), TenantDemand::equal(&[0])];
        let rr = round_robin(&[680.0], &one, &[4.0, 64.0]);
        assert!(close(rr[0], 40.0, 1e-9) && close(rr[1], 640.0, 1e-9));
        let pr = priority(&[680.0], &one, &[0, 1], &[4.0, 64.0]);
        assert!(close(pr[0], 680.0, 1e-9) && pr[1] == 0.0);
        // Priority leaves the low tenant what the high one cannot use.
        let ts = [TenantDemand::equal(&[0, 1]), TenantDemand::equal(&[0])];
        let pr = priority(&[400.0, 160.0], &ts, &[0, 1], &[1.0, 1.0]);
        assert!(close(pr[0], 160.0, 1e-9) && close(pr[1], 240.0, 1e-9));
    }

    fn random_case(rng: &mut rand::rngs::StdRng) -> (Vec<f64>, Vec<TenantDemand>, Vec<u64>) {
        let caps: Vec<f64> = (0..NCLASSES)
            .map(|_| rng.gen_range(50.0..500.0) * 1e6)
            .collect();
        let n = rng.gen_range(2..=4);
        let mut ts = Vec::new();
        let mut sizes = Vec::new();
        for _ in 0..n {
            let uses: Vec<usize> = match rng.gen_range(0..3) {
                0 => vec![0],
                1 => vec![1],
                _ => vec![0, 1],
            };
            let mut t = TenantDemand::equal(&uses);
            if rng.gen_bool(0.3) {
                t = t.with_demand(rng.gen_range(10.0..150.0) * 1e6);
            }
            ts.push(t);
            sizes.push(rng.gen_range(1u64..=16) * 4096);
        }
        (caps, ts, sizes)
    }

    #[test]
    fn closed_form_is_the_first_step_and_the_fill_is_feasible_and_pareto() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(14);
        for _ in 0..500 {
            let (caps, mut ts, _) = random_case(&mut rng);
            for t in &mut ts {
                t.demand = None;
            }
            let (s, cf) = closed_form(&caps, &ts);
            let a = drf(&caps, &ts);
            for t in 0..ts.len() {
                assert!(a[t] >= cf[t] * (1.0 - 1e-9), "filling never takes away");
                assert!(
                    close(cf[t] / bottleneck(&caps, &ts[t]), s, 1e-9),
                    "equal shares"
                );
            }
            for (j, cap) in caps.iter().enumerate() {
                let used: f64 = ts
                    .iter()
                    .zip(&a)
                    .flat_map(|(t, at)| {
                        t.uses
                            .iter()
                            .filter(move |u| u.0 == j)
                            .map(move |u| at * u.1)
                    })
                    .sum();
                assert!(used <= cap * (1.0 + 1e-9), "class {j} over capacity");
            }
            // Pareto: every tenant uses a saturated class.
            for (t, d) in ts.iter().enumerate() {
                let sat = d.uses.iter().any(|&(j, _)| {
                    let used: f64 = ts
                        .iter()
                        .zip(&a)
                        .flat_map(|(t2, at)| {
                            t2.uses
                                .iter()
                                .filter(move |u| u.0 == j)
                                .map(move |u| at * u.1)
                        })
                        .sum();
                    used >= caps[j] * (1.0 - 1e-6)
                });
                assert!(sat, "tenant {t} could still grow");
            }
        }
    }

    /// A discrete-event simulation in virtual time: each class is one engine
    /// of capacity C_j serving jobs the real [`Scheduler`] picks; each
    /// tenant is a chain of pipes (one per class it uses) joined by bounded
    /// rings, fed by a source of the tenant's demand rate.
    fn simulate(caps: &[f64], ts: &[TenantDemand], sizes: &[u64], seconds: f64) -> Vec<f64> {
        struct Stage {
            class: usize,
            input: f64,
            busy: bool,
        }
        let n = ts.len();
        let mut sched: Scheduler<(usize, usize)> = Scheduler::new(SchedConfig {
            policy: Policy::Drf,
            nominal: [caps[0], caps[1]],
            max_inflight: 1,
        });
        // Staging rings hold several jobs (as real staging rings do), so a
        // stage is not starved while its engine serves another tenant.
        let buf = |t: usize| (8.0 * sizes[t] as f64).max(512.0 * 1024.0);
        let mut stages: Vec<Vec<Stage>> = ts
            .iter()
            .map(|t| {
                t.uses
                    .iter()
                    .map(|&(c, _)| Stage {
                        class: c,
                        input: 0.0,
                        busy: false,
                    })
                    .collect()
            })
            .collect();
        let mut produced = vec![0.0f64; n];
        let mut delivered = vec![0.0f64; n];
        let warm = seconds * 0.2;
        let mut at_warm = vec![0.0f64; n];
        let mut running: Vec<Option<(usize, usize, f64)>> = vec![None; caps.len()];
        let mut now = 0.0;
        let pipe = |t: usize, k: usize| (t * 4 + k) as u32;
        while now < seconds {
            // Sources: what the tenant's demand rate has produced by now.
            for t in 0..n {
                let limit = ts[t].demand.map_or(f64::INFINITY, |d| d * now);
                let room = buf(t) - stages[t][0].input;
                let add = (limit - produced[t]).min(room).max(0.0);
                produced[t] += add;
                stages[t][0].input += add;
            }
            // Pipes with a full job of input and room downstream enqueue it.
            for t in 0..n {
                let size = sizes[t] as f64;
                for k in 0..stages[t].len() {
                    let room = if k + 1 < stages[t].len() {
                        buf(t) - stages[t][k + 1].input
                    } else {
                        f64::INFINITY
                    };
                    let st = &stages[t][k];
                    if !st.busy
                        && st.input >= size
                        && room >= size
                        && sched.queued(pipe(t, k)) == 0
                        && sched.inflight(pipe(t, k)) == 0
                    {
                        let class = if st.class == 0 {
                            Class::Copy
                        } else {
                            Class::Crypto
                        };
                        sched.enqueue(
                            pipe(t, k),
                            t as u32,
                            0,
                            Queued {
                                class,
                                cost: sizes[t],
                                barrier: false,
                                payload: (t, k),
                            },
                        );
                    }
                }
            }
            // Idle engines take the next job of their class.
            for j in 0..caps.len() {
                if running[j].is_none() {
                    if let Some((_, q)) = sched.next(1 << j) {
                        let (t, k) = q.payload;
                        stages[t][k].busy = true;
                        let done = now + sizes[t] as f64 / caps[j];
                        running[j] = Some((t, k, done));
                    }
                }
            }
            // Advance to the next event: a completion, or a source's next job.
            let mut next = f64::INFINITY;
            for r in running.iter().flatten() {
                next = next.min(r.2);
            }
            for t in 0..n {
                if let Some(d) = ts[t].demand {
                    if stages[t][0].input < sizes[t] as f64 {
                        next = next.min((produced[t] + sizes[t] as f64 - stages[t][0].input) / d);
                    }
                }
            }
            if !next.is_finite() {
                break;
            }
            let before = now;
            now = next.max(now + 1e-12);
            if before < warm && now >= warm {
                at_warm.copy_from_slice(&delivered);
            }
            for slot in running.iter_mut() {
                if let Some((t, k, done)) = *slot {
                    if done <= now {
                        *slot = None;
                        let size = sizes[t] as f64;
                        stages[t][k].busy = false;
                        stages[t][k].input -= size;
                        if k + 1 < stages[t].len() {
                            stages[t][k + 1].input += size;
                        } else {
                            delivered[t] += size;
                        }
                        sched.complete(pipe(t, k), false);
                    }
                }
            }
        }
        (0..n)
            .map(|t| (delivered[t] - at_warm[t]) / (now - warm))
            .collect()
    }

    #[test]
    fn drf_scheduler_matches_the_formula_in_virtual_time() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1403);
        for case in 0..25 {
            let (caps, ts, sizes) = random_case(&mut rng);
            let want = drf(&caps, &ts);
            let got = simulate(&caps, &ts, &sizes, 2.0);
            for t in 0..ts.len() {
                let tol = 0.05 * want[t] + 0.01 * caps.iter().cloned().fold(0.0, f64::max);
                assert!(
                    (got[t] - want[t]).abs() <= tol,
                    "case {case}: tenant {t} got {:.1} MB/s, formula {:.1} MB/s (caps {caps:?}, tenants {ts:?}, sizes {sizes:?})",
                    got[t] / 1e6,
                    want[t] / 1e6
                );
            }
        }
    }
}
