//! jemalloc's raw heap dump (`heap_v2`), read with all four of Go's heap sample types.
//!
//! A dump lists, for each sampled allocation stack, `t*: <live objects>: <live bytes>
//! [<allocated objects>: <allocated bytes>]`. The live pair is what is in use now; the bracketed
//! pair counts every sampled allocation since start-up, freed or not, and jemalloc fills it only
//! with `prof_accum:true` (otherwise it is `[0: 0]`). Both pairs are sampled counts, unbiased
//! the way `jeprof` does it (`AdjustSamples`): scaled by `1 / (1 - e^(-avg_size / rate))`.
//!
//! Go's heap profile has the sample types `alloc_objects/count`, `alloc_space/bytes`,
//! `inuse_objects/count`, `inuse_space/bytes` (in that order) and the period type
//! `space/bytes`; we produce the same, and leave the two `alloc_` types out when the process
//! does not count cumulative allocations (so no profile claims zeros it did not measure).

use std::collections::HashMap;
use std::io::BufRead;

use anyhow::{Context, bail};
use jemalloc_pprof::Mapping;

/// Go's heap sample types, in Go's order; [`HeapStack::values`] follows it.
pub(crate) const SAMPLE_TYPES: [(&str, &str); 4] = [
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
];
/// Index of `alloc_space` in [`SAMPLE_TYPES`].
pub(crate) const ALLOC_SPACE: usize = 1;
/// Index of `inuse_space` in [`SAMPLE_TYPES`].
pub(crate) const INUSE_SPACE: usize = 3;

/// One allocation stack and its estimated (unbiased) totals.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HeapStack {
    /// Return addresses, outermost (root) first.
    pub addrs: Vec<usize>,
    /// Values in the order of [`SAMPLE_TYPES`].
    pub values: [f64; 4],
}

/// A parsed heap dump.
#[derive(Debug, Default)]
pub(crate) struct HeapProfile {
    /// Average bytes between samples (`2^lg_prof_sample`).
    pub sampling_rate: u64,
    /// Whether the `alloc_` values were counted (`opt.prof_accum`).
    pub accum: bool,
    /// The stacks, in dump order.
    pub stacks: Vec<HeapStack>,
    /// The process's mappings, for the pprof output.
    pub mappings: Vec<Mapping>,
}

impl HeapProfile {
    /// The indices into [`SAMPLE_TYPES`] this profile can honestly report.
    pub(crate) fn type_indices(&self) -> &'static [usize] {
        if self.accum { &[0, 1, 2, 3] } else { &[2, 3] }
    }
}

/// Whether this process's jemalloc counts cumulative allocations (`opt.prof_accum`).
pub(crate) fn accum_enabled() -> bool {
    // SAFETY: "opt.prof_accum" is documented as a readable bool
    // (https://jemalloc.net/jemalloc.3.html#opt.prof_accum); raw::read reads it into a bool.
    unsafe { tikv_jemalloc_ctl::raw::read::<bool>(b"opt.prof_accum\0") }.unwrap_or(false)
}

/// `jeprof`'s unbiasing of one (objects, bytes) pair of sampled counts.
fn unbias(objects: f64, bytes: f64, rate: f64) -> (f64, f64) {
    if objects <= 0.0 || bytes <= 0.0 || rate <= 0.0 {
        return (0.0, 0.0);
    }
    let ratio = (bytes / objects) / rate;
    let scale = 1.0 / (1.0 - (-ratio).exp());
    (objects * scale, bytes * scale)
}

/// Parses a `heap_v2` dump.
pub(crate) fn parse(
    dump: impl BufRead,
    accum: bool,
    mappings: &[Mapping],
) -> anyhow::Result<HeapProfile> {
    let mut lines = dump.lines();
    let first = lines.next().context("the heap dump is empty")??;
    let rate: u64 = first
        .trim()
        .strip_prefix("heap_v2/")
        .and_then(|r| r.parse().ok())
        .with_context(|| format!("not a heap_v2 dump: first line {first:?}"))?;
    let mut profile = HeapProfile {
        sampling_rate: rate,
        accum,
        stacks: Vec::new(),
        mappings: mappings.to_vec(),
    };
    let mut stack: Option<Vec<usize>> = None;
    for line in lines {
        let line = line.context("reading the heap dump")?;
        let line = line.trim();
        if let Some(addrs) = line.strip_prefix("@ ") {
            if stack.is_some() {
                bail!("heap dump: a stack without counts");
            }
            let mut addrs = addrs
                .split_ascii_whitespace()
                .map(|a| usize::from_str_radix(a.trim_start_matches("0x"), 16))
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("heap dump: bad stack line {line:?}"))?;
            addrs.reverse(); // jemalloc lists the leaf first
            stack = Some(addrs);
        } else if let Some(counts) = line.strip_prefix("t*:") {
            // The first `t*:` line (before any stack) is the process total: skip it.
            let Some(addrs) = stack.take() else { continue };
            let v =
                parse_counts(counts).with_context(|| format!("heap dump: bad counts {line:?}"))?;
            let (inuse_objects, inuse_space) = unbias(v[0], v[1], rate as f64);
            let (alloc_objects, alloc_space) = if accum {
                unbias(v[2], v[3], rate as f64)
            } else {
                (0.0, 0.0)
            };
            profile.stacks.push(HeapStack {
                addrs,
                values: [alloc_objects, alloc_space, inuse_objects, inuse_space],
            });
        }
    }
    if stack.is_some() {
        bail!("heap dump: a stack without counts");
    }
    Ok(profile)
}

/// ` 12: 3456 [78: 9012]` → [12, 3456, 78, 9012].
fn parse_counts(s: &str) -> Option<[f64; 4]> {
    let cleaned: String = s
        .chars()
        .map(|c| if matches!(c, ':' | '[' | ']') { ' ' } else { c })
        .collect();
    let v: Vec<f64> = cleaned
        .split_ascii_whitespace()
        .map(|w| w.parse::<f64>().ok())
        .collect::<Option<_>>()?;
    match v.as_slice() {
        [a, b, c, d] => Some([*a, *b, *c, *d]),
        [a, b] => Some([*a, *b, 0.0, 0.0]),
        _ => None,
    }
}

/// What changed between two dumps, per stack: the growth of what is live (stacks that shrank
/// count 0) and what was allocated in between. Stacks with nothing positive are left out.
pub(crate) fn growth(before: &HeapProfile, after: HeapProfile) -> HeapProfile {
    let mut base: HashMap<&[usize], [f64; 4]> = HashMap::new();
    for s in &before.stacks {
        let e = base.entry(s.addrs.as_slice()).or_default();
        for (x, v) in e.iter_mut().zip(s.values) {
            *x += v;
        }
    }
    let mut now: HashMap<Vec<usize>, [f64; 4]> = HashMap::new();
    for s in after.stacks {
        let e = now.entry(s.addrs).or_default();
        for (x, v) in e.iter_mut().zip(s.values) {
            *x += v;
        }
    }
    let mut stacks: Vec<HeapStack> = now
        .into_iter()
        .filter_map(|(addrs, values)| {
            let b = base.get(addrs.as_slice()).copied().unwrap_or_default();
            let d: [f64; 4] = std::array::from_fn(|i| (values[i] - b[i]).max(0.0));
            d.iter()
                .any(|v| *v >= 1.0)
                .then_some(HeapStack { addrs, values: d })
        })
        .collect();
    stacks.sort_by(|a, b| a.addrs.cmp(&b.addrs));
    HeapProfile {
        sampling_rate: after.sampling_rate,
        accum: after.accum,
        stacks,
        mappings: after.mappings,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DUMP: &str = "heap_v2/2097152
  t*: 3: 6291456 [10: 20971520]
  t0: 3: 6291456 [10: 20971520]
@ 0x10 0x20 0x30
  t*: 2: 4194304 [8: 16777216]
  t0: 2: 4194304 [8: 16777216]
@ 0x11 0x30
  t*: 1: 2097152 [2: 4194304]

MAPPED_LIBRARIES:
55d1c0000000-55d1c0100000 r--p 00000000 fd:01 123 /bin/x
";

    #[test]
    fn parses_all_four_types_unbiased() {
        let p = parse(DUMP.as_bytes(), true, &[]).unwrap();
        assert_eq!(p.sampling_rate, 2097152);
        assert_eq!(p.stacks.len(), 2);
        assert_eq!(p.stacks[0].addrs, vec![0x30, 0x20, 0x10], "root first");
        // Average size = the rate: scale 1 / (1 - e^-1) = 1.582.
        let scale = 1.0 / (1.0 - (-1.0f64).exp());
        let v = p.stacks[0].values;
        assert!((v[INUSE_SPACE] - 4194304.0 * scale).abs() < 1.0, "{v:?}");
        assert!((v[2] - 2.0 * scale).abs() < 1e-9, "{v:?}");
        assert!((v[ALLOC_SPACE] - 16777216.0 * scale).abs() < 1.0, "{v:?}");
        assert!((v[0] - 8.0 * scale).abs() < 1e-9, "{v:?}");
        assert_eq!(p.type_indices(), &[0, 1, 2, 3]);
    }

    #[test]
    fn without_accum_the_alloc_types_are_left_out() {
        let p = parse(DUMP.as_bytes(), false, &[]).unwrap();
        assert_eq!(p.type_indices(), &[2, 3]);
        assert_eq!(p.stacks[0].values[ALLOC_SPACE], 0.0);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            "",
            "heap_v3/1\n",
            "heap_v2/x\n",
            "heap_v2/4\n@ 0xzz\n  t*: 1: 2 [0: 0]\n",
            "heap_v2/4\n@ 0x1\n",
        ] {
            assert!(parse(bad.as_bytes(), true, &[]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn growth_keeps_what_grew_and_what_was_allocated() {
        let stack = |addrs: &[usize], values: [f64; 4]| HeapStack {
            addrs: addrs.to_vec(),
            values,
        };
        let before = HeapProfile {
            accum: true,
            stacks: vec![
                stack(&[1, 2], [1.0, 100.0, 1.0, 100.0]),
                stack(&[3], [5.0, 500.0, 2.0, 50.0]),
                stack(&[4], [1.0, 10.0, 1.0, 10.0]),
            ],
            ..Default::default()
        };
        let after = HeapProfile {
            accum: true,
            stacks: vec![
                stack(&[1, 2], [3.0, 300.0, 3.0, 300.0]),
                stack(&[3], [9.0, 900.0, 1.0, 20.0]),
                stack(&[5, 6], [1.0, 7.0, 1.0, 7.0]),
                stack(&[4], [1.0, 10.0, 1.0, 10.0]),
            ],
            ..Default::default()
        };
        let d = growth(&before, after);
        assert_eq!(
            d.stacks,
            vec![
                stack(&[1, 2], [2.0, 200.0, 2.0, 200.0]),
                stack(&[3], [4.0, 400.0, 0.0, 0.0]),
                stack(&[5, 6], [1.0, 7.0, 1.0, 7.0]),
            ]
        );
    }
}
