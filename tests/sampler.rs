//! The sampler against a plain reference: the tokens temperature, top-k, top-p and min-p keep,
//! and their probabilities, equal those of a full sort of the vocabulary (the obvious way, which
//! the sampler avoids for speed); its exponential against `f32::exp`; and its draws follow the
//! probabilities. Speed is not asserted here (examples/sampler_speed.rs prints it).

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shoal::engine::sampler::{exp_nonpositive, Sampler, SamplingParams};

/// What a full sort keeps: softmax(logits / temperature) over the top-k, then the shortest
/// best-first prefix reaching top_p, cut where a probability falls below min_p × the best.
fn reference(logits: &[f32], p: &SamplingParams) -> BTreeMap<u32, f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut c: Vec<(u32, f32)> = logits.iter().enumerate().filter(|(_, l)| **l >= max - 40.0 * p.temperature).map(|(i, l)| (i as u32, *l)).collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if let Some(k) = p.top_k {
        c.truncate(k);
    }
    let w: Vec<f64> = c.iter().map(|(_, l)| (((l - max) / p.temperature) as f64).exp()).collect();
    let total: f64 = w.iter().sum();
    let probs: Vec<f64> = w.iter().map(|x| x / total).collect();
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        keep = probs.iter().position(|q| {
            acc += q;
            acc >= p.top_p as f64
        }).map_or(keep, |i| i + 1);
    }
    keep = keep.min(probs.iter().take_while(|q| **q >= p.min_p as f64 * probs[0]).count().max(1));
    let kept: f64 = probs[..keep].iter().sum();
    c[..keep].iter().zip(&probs).map(|((id, _), q)| (*id, q / kept)).collect()
}

/// The sampler's kept tokens, normalised to probabilities.
fn fast(logits: &[f32], p: &SamplingParams) -> BTreeMap<u32, f64> {
    let mut s = Sampler::new(p.clone()).expect("valid settings");
    let mut l = logits.to_vec();
    let kept = s.distribution(&mut l);
    let total: f64 = kept.iter().map(|c| c.1 as f64).sum();
    kept.iter().map(|(id, w)| (*id, *w as f64 / total)).collect()
}

/// Logits shaped like a model's: most tokens near zero, a few far above.
fn model_like(rng: &mut StdRng, n: usize, peaks: usize) -> Vec<f32> {
    let mut l: Vec<f32> = (0..n).map(|_| (0..4).map(|_| rng.random::<f32>()).sum::<f32>() * 3.0 - 6.0).collect();
    for _ in 0..peaks {
        let i = rng.random_range(0..n);
        l[i] += rng.random_range(5.0..20.0);
    }
    l
}

#[test]
fn kept_tokens_and_probabilities_equal_a_full_sort() {
    let mut rng = StdRng::seed_from_u64(3);
    let settings = [
        SamplingParams { temperature: 0.8, ..Default::default() },
        SamplingParams { temperature: 1.0, top_k: Some(40), ..Default::default() },
        SamplingParams { temperature: 0.7, top_p: 0.9, ..Default::default() },
        SamplingParams { temperature: 1.2, min_p: 0.05, ..Default::default() },
        SamplingParams { temperature: 1.0, top_k: Some(40), top_p: 0.95, min_p: 0.05, ..Default::default() },
        SamplingParams { temperature: 0.5, top_k: Some(1000), top_p: 0.5, ..Default::default() },
        SamplingParams { temperature: 2.0, top_p: 0.99, ..Default::default() },
    ];
    let mut vocabularies = vec![model_like(&mut rng, 151_936, 30), model_like(&mut rng, 32_000, 3), model_like(&mut rng, 5_000, 0)];
    // Ties: the lower token id goes first, as in the reference's sort.
    vocabularies.push((0..2_000).map(|i| (i % 7) as f32).collect());
    for (v, logits) in vocabularies.iter().enumerate() {
        for p in &settings {
            let (want, got) = (reference(logits, p), fast(logits, p));
            // A top-p cut through thousands of near-equal tokens may fall a few tokens apart
            // with other rounding: the tokens kept by only one side must weigh next to nothing.
            let one_sided: f64 = want.iter().filter(|(id, _)| !got.contains_key(id)).map(|(_, q)| q).sum::<f64>() + got.iter().filter(|(id, _)| !want.contains_key(id)).map(|(_, q)| q).sum::<f64>();
            assert!(one_sided < 1e-4, "vocabulary {v}, {p:?}: {} and {} tokens kept, {one_sided:e} of the mass on one side only", got.len(), want.len());
            for (id, q) in want.iter().filter(|(id, _)| got.contains_key(id)) {
                assert!((got[id] - q).abs() <= 1e-4 * q + 1e-9, "vocabulary {v}, {p:?}: token {id} has probability {} against {q}", got[id]);
            }
        }
    }
}

#[test]
fn exponential_is_within_1e5_of_exp() {
    let mut worst = 0f64;
    for i in 0..=200_000 {
        let x = -87.0 * i as f32 / 200_000.0;
        let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
        worst = worst.max((got - want).abs() / want);
    }
    assert!(worst < 1e-5, "largest relative error {worst:e}");
    assert_eq!(exp_nonpositive(0.0), 1.0);
    assert!(exp_nonpositive(-200.0) < 1e-37);
}

#[test]
fn draws_follow_the_kept_probabilities() {
    let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0, -30.0, f32::NAN];
    // Plain temperature draws straight from the weights; the cuts go through the candidates.
    for p in [SamplingParams { temperature: 1.0, seed: Some(11), ..Default::default() }, SamplingParams { temperature: 1.0, top_p: 0.95, seed: Some(11), ..Default::default() }] {
        let want = reference(&logits, &p);
        let mut s = Sampler::new(p.clone()).expect("valid settings");
        let n = 40_000;
        let mut counts = BTreeMap::new();
        for _ in 0..n {
            *counts.entry(s.sample(&mut logits.to_vec(), &[])).or_insert(0usize) += 1;
        }
        // Token 5 (e^-32 of the best) may never come up in 40,000 draws.
        let drawn: Vec<u32> = counts.keys().copied().collect();
        let kept: Vec<u32> = want.iter().filter(|(_, q)| **q > 1e-9).map(|(id, _)| *id).collect();
        assert_eq!(drawn, kept, "{p:?}: drawn tokens are not the kept ones");
        for (id, q) in want.iter().filter(|(_, q)| **q > 1e-9) {
            let seen = counts[id] as f64 / n as f64;
            let sigma = (q * (1.0 - q) / n as f64).sqrt();
            assert!((seen - q).abs() < 5.0 * sigma, "{p:?}: token {id} drawn {seen:.4} of the time, probability {q:.4}");
        }
    }
}
