//! Index arithmetic every backend shares: broadcast strides, merging of dimensions that can be
//! walked as one, and the passes of a reduction over several axes.

/// Strides (in elements) of a contiguous array of `shape` as seen from a broadcast result of
/// `out` dims: right-aligned, 0 where the input has size 1 (or is missing).
pub(crate) fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; out.len()];
    let offset = out.len() - shape.len();
    let mut stride = 1;
    for i in (0..shape.len()).rev() {
        if shape[i] != 1 {
            strides[offset + i] = stride;
        }
        stride *= shape[i];
    }
    strides
}

pub(crate) use crate::shape::contiguous_strides;

/// The output `out` with per-operand strides `operand_strides`, with size-1 dimensions dropped
/// and each dimension merged into the one before it where, for every operand, stepping once
/// along the earlier one equals stepping through all of the later one (contiguous, or broadcast
/// along both). Walking the merged dims visits the same elements in the same order with fewer,
/// longer inner loops. Returns the merged dims and, per operand, the merged strides.
pub(crate) fn merge_dims(
    out: &[usize],
    operand_strides: &[Vec<usize>],
) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut dims: Vec<usize> = Vec::with_capacity(out.len());
    let mut strides: Vec<Vec<usize>> = vec![Vec::with_capacity(out.len()); operand_strides.len()];
    for (i, &d) in out.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let mergeable = !dims.is_empty()
            && operand_strides
                .iter()
                .zip(&strides)
                .all(|(s, merged)| merged.last().is_some_and(|&prev| prev == s[i] * d));
        if mergeable {
            let last = dims.len() - 1;
            dims[last] *= d;
            for (merged, s) in strides.iter_mut().zip(operand_strides) {
                let l = merged.len() - 1;
                merged[l] = s[i];
            }
        } else {
            dims.push(d);
            for (merged, s) in strides.iter_mut().zip(operand_strides) {
                merged.push(s[i]);
            }
        }
    }
    (dims, strides)
}

/// One pass of a reduction: fold the middle axis of `[outer, n, inner]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pass {
    pub outer: usize,
    pub n: usize,
    pub inner: usize,
}

/// The passes that reduce the axes of `dims` marked in `reduced`, last run of reduced axes
/// first: the first pass reads the input, each later one the previous pass's result. Size-1
/// axes are ignored and adjacent axes of the same kind merged, so a reduction over the last or
/// the first axes of a contiguous array is one pass. Empty when every reduced axis has size 1
/// (nothing to combine: the result is the input, converted).
pub(crate) fn reduction_passes(dims: &[usize], reduced: &[bool]) -> Vec<Pass> {
    let mut groups: Vec<(usize, bool)> = Vec::with_capacity(dims.len());
    for (&d, &r) in dims.iter().zip(reduced) {
        push_group(&mut groups, d, r);
    }
    let mut passes = Vec::new();
    while let Some(last) = groups.iter().rposition(|g| g.1) {
        let outer: usize = groups[..last].iter().map(|g| g.0).product();
        let inner: usize = groups[last + 1..].iter().map(|g| g.0).product();
        passes.push(Pass {
            outer,
            n: groups[last].0,
            inner,
        });
        groups = remove_group(&groups, last);
    }
    passes
}

fn push_group(groups: &mut Vec<(usize, bool)>, size: usize, reduced: bool) {
    if size == 1 {
        return;
    }
    match groups.last_mut() {
        Some((n, r)) if *r == reduced => *n *= size,
        _ => groups.push((size, reduced)),
    }
}

fn remove_group(groups: &[(usize, bool)], at: usize) -> Vec<(usize, bool)> {
    let mut merged = Vec::with_capacity(groups.len());
    for (i, &(size, reduced)) in groups.iter().enumerate() {
        if i != at {
            push_group(&mut merged, size, reduced);
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_merge_runs_of_axes() {
        let p = |outer, n, inner| Pass { outer, n, inner };
        // Last two axes: one pass over contiguous rows.
        assert_eq!(
            reduction_passes(&[2, 3, 4], &[false, true, true]),
            vec![p(2, 12, 1)]
        );
        // First and last: the last run, then the first over the accumulators.
        assert_eq!(
            reduction_passes(&[2, 3, 4], &[true, false, true]),
            vec![p(6, 4, 1), p(1, 2, 3)]
        );
        // Size-1 axes do not count.
        assert_eq!(
            reduction_passes(&[1, 5, 1], &[true, false, true]),
            Vec::<Pass>::new()
        );
    }

    #[test]
    fn merging_keeps_broadcast_axes_apart() {
        let out = [4, 3, 5];
        let a = contiguous_strides(&out);
        let b = broadcast_strides(&[3, 1], &out);
        let (dims, strides) = merge_dims(&out, &[a, b]);
        assert_eq!(dims, vec![4, 3, 5]);
        assert_eq!(strides, vec![vec![15, 5, 1], vec![0, 1, 0]]);
        let (dims, _) = merge_dims(&out, &[contiguous_strides(&out)]);
        assert_eq!(dims, vec![60]);
    }
}
