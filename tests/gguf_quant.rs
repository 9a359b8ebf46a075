//! GGUF loading: models written as GGUF (by candle's writer, from HF-named f32 weights) in
//! every supported tensor type run quantized and agree with the f32 safetensors run within a
//! per-type error budget; a llama-architecture GGUF (q/k rows permuted as llama.cpp's
//! converter does, rotary on adjacent pairs) matches transformers exactly.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use shoal::engine::model::ModelSource;
use shoal::engine::{LayerRange, ShardInput, ShardOutput};

use crate::util::{fixture, max_abs_diff, reference};

/// HF tensor name → GGUF tensor name (llama-shaped families).
fn gguf_name(hf: &str) -> String {
    let fixed = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let rest = hf.strip_prefix("model.layers.").expect("a layer tensor");
    let (layer, name) = rest.split_once('.').expect("layer index");
    let map = [
        ("input_layernorm.weight", "attn_norm.weight"),
        ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ("self_attn.q_proj.weight", "attn_q.weight"),
        ("self_attn.k_proj.weight", "attn_k.weight"),
        ("self_attn.v_proj.weight", "attn_v.weight"),
        ("self_attn.o_proj.weight", "attn_output.weight"),
        ("self_attn.q_proj.bias", "attn_q.bias"),
        ("self_attn.k_proj.bias", "attn_k.bias"),
        ("self_attn.v_proj.bias", "attn_v.bias"),
        ("mlp.gate_proj.weight", "ffn_gate.weight"),
        ("mlp.up_proj.weight", "ffn_up.weight"),
        ("mlp.down_proj.weight", "ffn_down.weight"),
    ];
    let (_, g) = map.iter().find(|(h, _)| *h == name).unwrap_or_else(|| panic!("unmapped tensor {hf}"));
    format!("blk.{layer}.{g}")
}

/// llama.cpp's converter permutes q/k rows so that rotary pairs become adjacent.
fn permute_for_llama_gguf(w: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = w.dims2().expect("2-d");
    w.reshape((heads, 2, rows / heads / 2, cols)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((rows, cols)).unwrap()
}

/// Writes `tensors` as a GGUF of `dtype` (1-d tensors stay f32). With `round_trip`, each
/// matrix is quantized and dequantized back to f32 first: the same weights, unquantized kernels.
fn write_gguf(path: &Path, arch: &str, cfg: &serde_json::Value, tensors: &HashMap<String, Tensor>, dtype: GgmlDType, round_trip: bool) {
    let u = |k: &str| gguf_file::Value::U32(cfg[k].as_u64().expect("config key") as u32);
    let theta = cfg["rope_parameters"]["rope_theta"].as_f64().expect("rope_theta") as f32;
    let meta: Vec<(String, gguf_file::Value)> = vec![
        ("general.architecture".into(), gguf_file::Value::String(arch.into())),
        (format!("{arch}.block_count"), u("num_hidden_layers")),
        (format!("{arch}.embedding_length"), u("hidden_size")),
        (format!("{arch}.feed_forward_length"), u("intermediate_size")),
        (format!("{arch}.attention.head_count"), u("num_attention_heads")),
        (format!("{arch}.attention.head_count_kv"), u("num_key_value_heads")),
        (format!("{arch}.context_length"), u("max_position_embeddings")),
        (format!("{arch}.rope.freq_base"), gguf_file::Value::F32(theta)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), gguf_file::Value::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32)),
    ];
    let (heads, kv_heads) = (cfg["num_attention_heads"].as_u64().unwrap() as usize, cfg["num_key_value_heads"].as_u64().unwrap() as usize);
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let qtensors: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|hf| {
            let mut t = tensors[hf].clone();
            if arch == "llama" && hf.ends_with("q_proj.weight") {
                t = permute_for_llama_gguf(&t, heads);
            } else if arch == "llama" && hf.ends_with("k_proj.weight") {
                t = permute_for_llama_gguf(&t, kv_heads);
            }
            let ty = if t.rank() == 1 { GgmlDType::F32 } else { dtype };
            let q = QTensor::quantize(&t, ty).expect("quantizes");
            let q = if round_trip { QTensor::quantize(&q.dequantize(&Device::Cpu).unwrap(), GgmlDType::F32).unwrap() } else { q };
            (gguf_name(hf), q)
        })
        .collect();
    let meta_refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path).expect("gguf file");
    gguf_file::write(&mut f, &meta_refs, &tensor_refs).expect("gguf writes");
}

fn prefill_logits(model: &Path, prompt: &[u32]) -> Vec<Vec<f32>> {
    let source = ModelSource::open(model).unwrap_or_else(|e| panic!("{}: {e}", model.display()));
    let shard = source.load_shard(LayerRange::full(source.spec.num_layers), &Device::Cpu).expect("shard loads");
    let mut cache = shard.new_cache();
    let ShardOutput::Logits(l) = shard.forward(ShardInput::Tokens(prompt), &mut cache, true).expect("forward") else { panic!("logits") };
    l.to_vec2::<f32>().expect("2-d")
}

#[test]
fn llama_gguf_with_permuted_qk_matches_transformers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = fixture("mistral");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).expect("fixture weights");
    let path = dir.path().join("mistral-f32.gguf");
    write_gguf(&path, "llama", &cfg, &tensors, GgmlDType::F32, false);
    let r = reference("mistral");
    let ours = prefill_logits(&path, &r.prompt_ids);
    for (pos, (a, b)) in ours.iter().zip(&r.prefill_logits).enumerate() {
        let d = max_abs_diff(a, b);
        assert!(d <= 1e-4, "position {pos}: llama GGUF logits differ from transformers by {d}");
    }
}

/// A random Qwen2-shaped model wide enough (256) for every k-quant block.
fn random_qwen2(dir: &Path) -> (serde_json::Value, HashMap<String, Tensor>) {
    let (hidden, inter, layers, heads, kv, vocab) = (256usize, 512usize, 2usize, 4usize, 2usize, 320usize);
    let head_dim = hidden / heads;
    let cfg = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": false, "hidden_act": "silu"
    });
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut t = |shape: &[usize], scale: f32, offset: f32| -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| offset + scale * (rng.random::<f32>() * 2.0 - 1.0)).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let mut w = HashMap::new();
    w.insert("model.embed_tokens.weight".to_string(), t(&[vocab, hidden], 1.0, 0.0));
    w.insert("model.norm.weight".to_string(), t(&[hidden], 0.2, 1.0));
    w.insert("lm_head.weight".to_string(), t(&[vocab, hidden], 0.3, 0.0));
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        let s = 1.0 / (hidden as f32).sqrt() * 1.7;
        for (n, shape, scale, off) in [
            ("input_layernorm.weight", vec![hidden], 0.2, 1.0),
            ("post_attention_layernorm.weight", vec![hidden], 0.2, 1.0),
            ("self_attn.q_proj.weight", vec![heads * head_dim, hidden], s, 0.0),
            ("self_attn.k_proj.weight", vec![kv * head_dim, hidden], s, 0.0),
            ("self_attn.v_proj.weight", vec![kv * head_dim, hidden], s, 0.0),
            ("self_attn.o_proj.weight", vec![hidden, heads * head_dim], s, 0.0),
            ("self_attn.q_proj.bias", vec![heads * head_dim], 0.1, 0.0),
            ("self_attn.k_proj.bias", vec![kv * head_dim], 0.1, 0.0),
            ("self_attn.v_proj.bias", vec![kv * head_dim], 0.1, 0.0),
            ("mlp.gate_proj.weight", vec![inter, hidden], s, 0.0),
            ("mlp.up_proj.weight", vec![inter, hidden], s, 0.0),
            ("mlp.down_proj.weight", vec![hidden, inter], 1.0 / (inter as f32).sqrt() * 1.7, 0.0),
        ] {
            w.insert(format!("{p}{n}"), t(&shape, scale, off));
        }
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).expect("safetensors saves");
    (cfg, w)
}

#[test]
fn every_supported_gguf_type_runs_quantized_close_to_f32() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (cfg, tensors) = random_qwen2(dir.path());
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 320).collect();
    let f32_logits = prefill_logits(dir.path(), &prompt);
    let rel_err = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        let scale = b.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).map(|(x, y)| max_abs_diff(x, y)).fold(0f32, f32::max) / scale
    };
    // Per type: budget against the same weights dequantized to f32 (only the kernels and the
    // 8-bit activations of quantized matmuls differ), and a loose sanity budget against the
    // original f32 weights (quantization noise of random uniform weights is large at 4 bits).
    for (dtype, kernel_budget, noise_budget) in [
        (GgmlDType::F32, 1e-6, 1e-6),
        (GgmlDType::F16, 1e-6, 5e-3),
        (GgmlDType::Q8_0, 0.03, 0.05),
        (GgmlDType::Q6K, 0.03, 0.1),
        (GgmlDType::Q5_0, 0.03, 0.15),
        (GgmlDType::Q4K, 0.03, 0.3),
        (GgmlDType::Q4_0, 0.03, 0.3),
    ] {
        let quantized = dir.path().join(format!("model-{dtype:?}.gguf"));
        let dequantized = dir.path().join(format!("model-{dtype:?}-f32.gguf"));
        write_gguf(&quantized, "qwen2", &cfg, &tensors, dtype, false);
        write_gguf(&dequantized, "qwen2", &cfg, &tensors, dtype, true);
        let ours = prefill_logits(&quantized, &prompt);
        let kernel_err = rel_err(&ours, &prefill_logits(&dequantized, &prompt));
        let noise = rel_err(&ours, &f32_logits);
        eprintln!("{dtype:?}: vs dequantized weights {kernel_err:.5}, vs original f32 {noise:.5}");
        assert!(kernel_err <= kernel_budget, "{dtype:?}: quantized kernels differ from the dequantized weights by {kernel_err} (budget {kernel_budget})");
        assert!(noise <= noise_budget, "{dtype:?}: output differs from f32 by {noise} (budget {noise_budget})");
    }
}

/// `shoal models quantize`'s writer: f16 GGUFs of the llama (Llama 3 rope scaling, carried as
/// `rope_freqs.weight`), mistral (q/k rows permuted) and qwen2 (biases) fixtures agree with
/// transformers within f16 rounding, and a Q4_K_M GGUF of a random Qwen2 stays within the
/// 4-bit noise budget of the f32 run above.
#[test]
fn quantize_writes_ggufs_that_agree_with_the_safetensors_run() {
    use shoal::engine::quantize::{quantize_hf_dir, QuantKind};
    let dir = tempfile::tempdir().expect("tempdir");
    let rel_err = |a: &[Vec<f32>], b: &[Vec<f32>]| {
        let scale = b.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        a.iter().zip(b).map(|(x, y)| max_abs_diff(x, y)).fold(0f32, f32::max) / scale
    };
    for name in ["llama", "mistral", "qwen2"] {
        let out = dir.path().join(format!("{name}-f16"));
        let report = quantize_hf_dir(&fixture(name), &out, QuantKind::F16).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(report.bytes > 0 && report.gguf.exists());
        let r = reference(name);
        let err = rel_err(&prefill_logits(&report.gguf, &r.prompt_ids), &r.prefill_logits);
        eprintln!("{name} f16 GGUF vs transformers: {err:.5}");
        assert!(err <= 5e-3, "{name}: the quantized GGUF differs from transformers by {err}");
    }
    let src = dir.path().join("random-qwen2");
    std::fs::create_dir_all(&src).unwrap();
    random_qwen2(&src);
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 320).collect();
    let report = quantize_hf_dir(&src, &dir.path().join("q4km"), QuantKind::Q4KM).expect("quantizes");
    let err = rel_err(&prefill_logits(&report.gguf, &prompt), &prefill_logits(&src, &prompt));
    eprintln!("random qwen2 Q4_K_M vs f32: {err:.5}");
    assert!(err <= 0.3, "Q4_K_M differs from f32 by {err}");
    // Gemma's GGUF norms differ: refused with a reason, nothing written.
    let gemma = quantize_hf_dir(&fixture("gemma3"), &dir.path().join("gemma"), QuantKind::Q8_0).unwrap_err();
    assert!(gemma.to_string().contains("gemma3"), "{gemma}");
    assert!(!dir.path().join("gemma/model.gguf").exists());
}
