//! The area under the ROC curve of scores against binary labels.

/// The AUC of `scores` against `labels` (a label above 0.5 is a positive): the probability that
/// a random positive scores above a random negative, ties counting one half, computed from the
/// ranks (Mann-Whitney's U, tied scores sharing their mean rank) in `O(n log n)`. NaN when there
/// is no positive or no negative.
pub fn auc(scores: &[f64], labels: &[f32]) -> f64 {
    assert_eq!(scores.len(), labels.len(), "one label per score");
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_unstable_by(|&a, &b| scores[a].total_cmp(&scores[b]));
    let (mut positives, mut rank_sum) = (0f64, 0f64);
    let mut start = 0;
    while start < order.len() {
        let mut end = start + 1;
        while end < order.len() && scores[order[end]] == scores[order[start]] {
            end += 1;
        }
        // Ranks start + 1 ..= end, 1-based: their mean for every tied score.
        let mean_rank = (start + 1 + end) as f64 / 2.0;
        for &i in &order[start..end] {
            if labels[i] > 0.5 {
                positives += 1.0;
                rank_sum += mean_rank;
            }
        }
        start = end;
    }
    let negatives = scores.len() as f64 - positives;
    if positives == 0.0 || negatives == 0.0 {
        return f64::NAN;
    }
    (rank_sum - positives * (positives + 1.0) / 2.0) / (positives * negatives)
}

#[cfg(test)]
mod tests {
    use super::auc;

    #[test]
    fn closed_forms() {
        let labels = [0.0, 0.0, 1.0, 1.0];
        assert_eq!(auc(&[0.1, 0.2, 0.8, 0.9], &labels), 1.0);
        assert_eq!(auc(&[0.9, 0.8, 0.2, 0.1], &labels), 0.0);
        assert_eq!(auc(&[0.5; 4], &labels), 0.5);
        // 3 of the 4 positive-negative pairs ordered right.
        assert_eq!(auc(&[0.1, 0.4, 0.35, 0.8], &labels), 0.75);
        // Ties count one half: (0.5, 0.5) a half, the other three pairs right.
        assert_eq!(auc(&[0.5, 0.5, 0.2, 0.9], &[1.0, 0.0, 0.0, 1.0]), 0.875);
        assert!(auc(&[0.3, 0.4], &[1.0, 1.0]).is_nan());
        assert!(auc(&[], &[]).is_nan());
    }

    #[test]
    fn agrees_with_counting_pairs() {
        let n = 300;
        let scores: Vec<f64> = (0..n).map(|i| ((i * 7919) % 101) as f64 / 10.0).collect();
        let labels: Vec<f32> = (0..n).map(|i| f32::from((i * 31 + i / 7) % 3 == 0)).collect();
        let (mut good, mut pairs) = (0f64, 0f64);
        for i in 0..n {
            for j in 0..n {
                if labels[i] == 1.0 && labels[j] == 0.0 {
                    pairs += 1.0;
                    good += if scores[i] > scores[j] {
                        1.0
                    } else if scores[i] == scores[j] {
                        0.5
                    } else {
                        0.0
                    };
                }
            }
        }
        assert!((auc(&scores, &labels) - good / pairs).abs() < 1e-12);
    }
}
