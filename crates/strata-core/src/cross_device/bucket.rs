//! Gradient fusion: grouping many tensors into few collectives.

/// The default fusion bucket size, as PyTorch DDP's and Horovod's: 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 * 1024 * 1024;

/// The default size of a block of rows of a weight's gradient reduced across workers on its
/// own, as soon as the backward pass has computed it: 2 MiB.
pub const DEFAULT_ROW_BLOCK_BYTES: usize = 2 * 1024 * 1024;

/// A run of consecutive tensors reduced by one collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Indices of the tensors in this bucket, consecutive and in order.
    pub tensors: std::ops::Range<usize>,
    /// Total f32 elements.
    pub elements: usize,
}

/// Groups tensors of `sizes` elements (f32), in order, into buckets of at most `bucket_bytes`.
/// A tensor larger than a bucket gets a bucket of its own; an empty list gives no bucket.
/// `bucket_bytes == 0` puts every tensor in a bucket of its own (no fusion).
pub fn plan_buckets(sizes: &[usize], bucket_bytes: usize) -> Vec<Bucket> {
    let cap = bucket_bytes / std::mem::size_of::<f32>();
    let mut out = Vec::new();
    let mut start = 0;
    let mut elements = 0usize;
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && (cap == 0 || elements + n > cap) {
            out.push(Bucket { tensors: start..i, elements });
            start = i;
            elements = 0;
        }
        elements += n;
    }
    if start < sizes.len() {
        out.push(Bucket { tensors: start..sizes.len(), elements });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuses_in_order_up_to_the_cap() {
        // cap = 10 elements
        let b = plan_buckets(&[4, 4, 4, 20, 1, 1], 40);
        let ranges: Vec<_> = b.iter().map(|b| (b.tensors.clone(), b.elements)).collect();
        assert_eq!(ranges, vec![(0..2, 8), (2..3, 4), (3..4, 20), (4..6, 2)]);
    }

    #[test]
    fn edge_cases() {
        assert!(plan_buckets(&[], 100).is_empty());
        assert_eq!(plan_buckets(&[3, 3], 0).len(), 2);
        assert_eq!(plan_buckets(&[3, 3], DEFAULT_BUCKET_BYTES).len(), 1);
        assert_eq!(plan_buckets(&[0, 0, 5], 4).iter().map(|b| b.elements).sum::<usize>(), 5);
    }
}
