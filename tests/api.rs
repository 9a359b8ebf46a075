//! The HTTP API against real `shoal` processes and real models, through real clients: the
//! official OpenAI Python SDK, `curl -N` for raw SSE, and reqwest. Covers streamed and whole
//! chat and completions, usage, models, the cluster view, errors, the API key, concurrency,
//! the bounded queue and its deadline, switching models, cancellation on disconnect, the
//! embedded UI and shutdown on SIGTERM.

mod fixture;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::util::repo_root;
use fixture::{block_on, curl, gemma_path, get, post, sdk_python, sse_data, Node, GEMMA, QWEN};

/// A completion that runs far longer than any test waits, to be cancelled.
fn long_completion(stream: bool) -> String {
    json!({"model": GEMMA, "prompt": "Write a very long story about the sea.", "max_tokens": 4000, "temperature": 0, "stream": stream}).to_string()
}

#[test]
fn openai_sdk_chat_stream_usage_completions_models_and_errors() {
    // No --model: the SDK's first request names Qwen, which the node then loads.
    let node = Node::start(&["serve", "--context", "256"]);
    let script = repo_root().join("tests/api/openai_client.py");
    let out = fixture::run_with_deadline(Command::new(sdk_python()).arg(&script).args([&node.url("/v1"), QWEN, "256"]), Duration::from_secs(240));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the SDK script failed: {stdout}\nnode stderr:\n{}", node.stderr());
    let r: Value = serde_json::from_str(stdout.trim()).expect("the script prints JSON");

    let chat = &r["chat"];
    let text = chat["text"].as_str().unwrap();
    assert!(!text.trim().is_empty(), "{chat}");
    assert_eq!((chat["object"].as_str(), chat["role"].as_str(), chat["model"].as_str()), (Some("chat.completion"), Some("assistant"), Some(QWEN)));
    let usage = &chat["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 10 && usage["completion_tokens"].as_u64().unwrap() > 0, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()));
    for key in ["time_to_first_token_s", "prefill_tok_s", "decode_tok_s"] {
        assert!(chat["shoal"][key].as_f64().is_some_and(|v| v > 0.0), "shoal.{key}: {chat}");
    }

    let stream = &r["chat_stream"];
    assert_eq!(stream["text"].as_str(), Some(text), "streamed greedy text must equal the whole response");
    assert_eq!(stream["finish_reason"], chat["finish_reason"]);
    assert_eq!(stream["roles"], json!(["assistant"]));
    assert!(stream["chunks"].as_u64().unwrap() >= 3, "{stream}");
    assert_eq!(stream["usage_chunk"], json!({"usage": usage, "choices": 0}), "include_usage: a last chunk with usage and no choices");

    let completion = &r["completion"];
    assert!(!completion["text"].as_str().unwrap().is_empty());
    assert_eq!(completion["text"], completion["streamed"]);
    assert_eq!(completion["object"], "text_completion");
    assert!(r["models"].as_array().unwrap().contains(&json!({"id": QWEN, "loaded": true})), "{}", r["models"]);

    let errors = &r["errors"];
    assert_eq!((errors["unknown_model"]["status"].as_u64(), errors["unknown_model"]["code"].as_str()), (Some(404), Some("model_not_found")), "{errors}");
    assert_eq!((errors["n2"]["status"].as_u64(), errors["n2"]["param"].as_str()), (Some(400), Some("n")), "{errors}");
    assert_eq!((errors["logprobs"]["status"].as_u64(), errors["logprobs"]["param"].as_str()), (Some(400), Some("logprobs")), "{errors}");
    for case in ["too_long", "too_long_stream"] {
        assert_eq!((errors[case]["status"].as_u64(), errors[case]["code"].as_str()), (Some(400), Some("context_length_exceeded")), "{case}: {errors}");
    }
}

#[test]
fn curl_reads_raw_sse_that_matches_the_whole_completion() {
    let node = Node::start(&["serve", "--model", &gemma_path()]);
    let request = |stream: bool| json!({"model": GEMMA, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "stream": stream}).to_string();
    let (status, whole) = block_on(post(&node.url("/v1/completions"), &request(false)));
    assert_eq!(status, 200, "{whole}");
    assert_eq!((whole["usage"]["completion_tokens"].as_u64(), whole["choices"][0]["finish_reason"].as_str()), (Some(12), Some("length")), "{whole}");

    let (status, body) = curl(&node.url("/v1/completions"), &request(true));
    assert_eq!(status, 200, "{body}");
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).expect("every chunk is JSON")).collect();
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap(), "streamed text must equal the whole completion");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last["shoal"]["decode_tok_s"].as_f64().unwrap() > 0.0, "{last}");
    assert!(chunks.iter().all(|c| c["object"] == "text_completion" && c["id"] == chunks[0]["id"]));

    // Gemma 3 270M is a base model without a chat template: chat is a clear 400, even streamed.
    for stream in [false, true] {
        let (status, body) = curl(&node.url("/v1/chat/completions"), &json!({"model": GEMMA, "messages": [{"role": "user", "content": "hi"}], "stream": stream}).to_string());
        assert_eq!(status, 400, "{body}");
        let e: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(e["error"]["code"], "chat_template_unavailable", "{body}");
        assert!(e["error"]["message"].as_str().unwrap().contains("no chat template"), "{body}");
    }
}

#[test]
fn bad_requests_get_openai_shaped_errors() {
    let node = Node::start(&["serve", "--model", &gemma_path(), "--context", "32"]);
    let url = node.url("/v1/completions");
    let too_long = format!(r#"{{"prompt": "{}", "model": "{GEMMA}"}}"#, "word ".repeat(50));
    let too_long_stream = format!(r#"{{"prompt": "{}", "stream": true}}"#, "word ".repeat(50));
    let cases = [
        ("{\"prompt\": \"hi\",", 400, "invalid_json", Value::Null),
        ("[1, 2]", 400, "invalid_json", Value::Null),
        (r#"{"prompt": "hi", "frobnicate": true}"#, 400, "unknown_parameter", json!("frobnicate")),
        (r#"{"prompt": "hi", "n": 2}"#, 400, "unsupported_parameter", json!("n")),
        (r#"{"prompt": "hi", "temperature": "hot"}"#, 400, "invalid_value", json!("temperature")),
        (r#"{"prompt": "hi", "model": "gpt-4o"}"#, 404, "model_not_found", json!("model")),
        (too_long.as_str(), 400, "context_length_exceeded", Value::Null),
        (too_long_stream.as_str(), 400, "context_length_exceeded", Value::Null),
    ];
    for (body, status, code, param) in cases {
        let (got, e) = block_on(post(&url, body));
        assert_eq!((got, e["error"]["code"].as_str()), (status, Some(code)), "{body} → {e}");
        assert_eq!(e["error"]["param"], param, "{body} → {e}");
        assert!(e["error"]["message"].as_str().is_some_and(|m| !m.is_empty()) && e["error"]["type"].is_string(), "{e}");
    }
    let (status, e) = block_on(get(&node.url("/v1/no-such-endpoint")));
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("not_found")));
    assert!(node.metric("shoal_errors_total{code=\"unknown_parameter\"}") >= 1.0);
}

#[test]
fn api_key_guards_v1_but_not_health_or_the_ui() {
    let node = Node::start(&["serve", "--api-key", "sesame"]);
    let client = reqwest::Client::new();
    let status = |req: reqwest::RequestBuilder| block_on(async { req.send().await.unwrap().status().as_u16() });
    assert_eq!(status(client.get(node.url("/v1/models"))), 401);
    assert_eq!(status(client.get(node.url("/v1/cluster")).bearer_auth("wrong")), 401);
    assert_eq!(status(client.post(node.url("/v1/chat/completions")).body("{}")), 401);
    assert_eq!(status(client.get(node.url("/v1/models")).bearer_auth("sesame")), 200);
    assert_eq!(status(client.get(node.url("/health"))), 200);
    assert_eq!(status(client.get(node.url("/"))), 200);
}

#[test]
fn four_concurrent_streams_all_complete_with_the_same_greedy_text() {
    let node = Node::start(&["serve", "--model", &gemma_path()]);
    let body = json!({"model": GEMMA, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "stream": true}).to_string();
    let url = node.url("/v1/completions");
    let texts: Vec<String> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    let (status, raw) = curl(&url, &body);
                    assert_eq!(status, 200, "{raw}");
                    let data = sse_data(&raw);
                    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{raw}");
                    data[..data.len() - 1].iter().map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string()).collect::<String>()
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().expect("a stream thread")).collect()
    });
    assert!(!texts[0].is_empty());
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
    // The engine reports each end to the scheduler just after the client's last event.
    node.wait_metric("shoal_generations_total{outcome=\"length\"}", Duration::from_secs(5), |v| v == 4.0);
}

#[test]
fn a_client_that_disconnects_cancels_its_generation() {
    let node = Node::start(&["serve", "--model", &gemma_path()]);
    block_on(async {
        let client = reqwest::Client::new();
        // A stream dropped after two chunks.
        let mut response = client.post(node.url("/v1/completions")).body(long_completion(true)).send().await.unwrap();
        assert_eq!(response.status(), 200);
        for _ in 0..2 {
            response.chunk().await.unwrap().expect("a chunk");
        }
        drop(response);
        node.wait_metric("shoal_generations_total{outcome=\"cancelled\"}", Duration::from_secs(30), |v| v == 1.0);
        // A whole (non-stream) request whose client gives up.
        let give_up = tokio::time::timeout(Duration::from_secs(3), client.post(node.url("/v1/completions")).body(long_completion(false)).send()).await;
        assert!(give_up.is_err(), "a 4000-token completion finished within 3 s?");
        node.wait_metric("shoal_generations_total{outcome=\"cancelled\"}", Duration::from_secs(30), |v| v == 2.0);
        // The engine is free again: the next request starts at once.
        let started = Instant::now();
        let (status, r) = post(&node.url("/v1/completions"), r#"{"prompt": "Hello", "max_tokens": 2, "temperature": 0}"#).await;
        assert_eq!(status, 200, "{r}");
        assert!(r["shoal"]["queued_s"].as_f64().unwrap() < 0.5, "{r}");
        assert!(started.elapsed() < Duration::from_secs(30));
    });
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let node = Node::start(&["serve", "--model", &gemma_path(), "--max-queue", "1"]);
    block_on(async {
        let client = reqwest::Client::new();
        let mut running = client.post(node.url("/v1/completions")).body(long_completion(true)).send().await.unwrap();
        running.chunk().await.unwrap().expect("the first request is generating");
        // The second waits in the queue (its headers come with its first token).
        let waiting = tokio::spawn(client.post(node.url("/v1/completions")).body(long_completion(true)).send());
        node.wait_metric("shoal_queue_depth", Duration::from_secs(10), |v| v == 1.0);
        let refused = client.post(node.url("/v1/completions")).body(long_completion(false)).send().await.unwrap();
        assert_eq!(refused.status(), 503);
        assert_eq!(refused.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("2"));
        let e: Value = refused.json().await.unwrap();
        assert_eq!(e["error"]["code"], "queue_full", "{e}");
        // The waiting client leaves: it is removed from the queue without ever running.
        waiting.abort();
        node.wait_metric("shoal_queue_abandoned_total", Duration::from_secs(10), |v| v == 1.0);
        assert_eq!(node.metric("shoal_queue_depth"), 0.0);
        drop(running);
        node.wait_metric("shoal_generations_total{outcome=\"cancelled\"}", Duration::from_secs(30), |v| v == 1.0);
    });
}

#[test]
fn cluster_and_models_match_the_contract() {
    // ~430 MB of weights (the tied embedding counts twice) and, at a 1,024-token context, 38 MB of
    // KV cache fit 500 MB; the 151 MB that 4,096 positions reserve would not.
    let node = Node::start(&["serve", "--model", &gemma_path(), "--memory-limit", "500MB", "--context", "1024"]);
    let (status, c) = block_on(get(&node.url("/v1/cluster")));
    assert_eq!(status, 200);
    assert_eq!((c["self"].as_str(), c["leader"].as_str(), c["epoch"].as_u64()), (Some(node.id.as_str()), Some(node.id.as_str()), Some(1)));
    let n = &c["nodes"][0];
    assert_eq!(c["nodes"].as_array().unwrap().len(), 1);
    assert_eq!((n["id"].as_str(), n["backend"].as_str(), n["memory_total"].as_u64()), (Some(node.id.as_str()), Some("cpu"), Some(500_000_000)));
    assert!(n["memory_available"].as_u64().unwrap() <= 500_000_000 - 253_000_000, "the loaded model counts against the limit: {n}");
    assert!(n["flops"].as_f64().unwrap() > 1e8 && n["mem_bandwidth"].as_f64().unwrap() > 1e8, "{n}");
    assert!(n["name"].is_string() && n["device"].is_string());
    assert_eq!(n["addresses"], json!([format!("127.0.0.1:{}", node.port)]));
    assert_eq!(n["models"], json!([GEMMA]));
    let plan = &c["plans"][0];
    assert_eq!((plan["model"].as_str(), plan["strategy"].as_str(), plan["epoch"].as_u64()), (Some(GEMMA), Some("single"), Some(1)));
    assert_eq!(plan["stages"], json!([{"node": node.id, "start": 0, "end": 18}]));
    assert_eq!((c["links"].clone(), c["progress"].clone(), c["error"].clone()), (json!([]), json!([]), Value::Null));

    let (_, models) = block_on(get(&node.url("/v1/models")));
    let find = |id: &str| models["data"].as_array().unwrap().iter().find(|m| m["id"] == id).cloned().unwrap_or_else(|| panic!("{id} listed: {models}"));
    let (gemma, qwen) = (find(GEMMA), find(QWEN));
    assert_eq!(gemma["shoal"]["loaded"], true);
    assert_eq!((gemma["shoal"]["family"].as_str(), gemma["shoal"]["layers"].as_u64(), gemma["shoal"]["format"].as_str()), (Some("gemma3"), Some(18), Some("gguf")));
    assert_eq!((qwen["shoal"]["loaded"].as_bool(), qwen["shoal"]["fits"].as_bool(), qwen["shoal"]["layers"].as_u64()), (Some(false), Some(false), Some(28)));
    // What the list says a model needs is what placement counts for this CPU node at its context.
    let source = shoal::engine::model::ModelSource::open(std::path::Path::new(&gemma_path())).expect("gemma opens");
    let placed = shoal::models::footprint(GEMMA, &source, Some(1024)).total_bytes_on(false);
    assert_eq!(gemma["shoal"]["needed_bytes"].as_u64(), Some(placed));
    assert!((430_000_000..500_000_000).contains(&placed), "weights and a 1,024-position cache: {placed}");
    assert!(qwen["shoal"]["needed_bytes"].as_u64().unwrap() > 1_000_000_000, "{qwen}");
    assert_eq!((models["object"].as_str(), gemma["owned_by"].as_str()), (Some("list"), Some("shoal")));

    // Qwen (1.1 GB) does not fit in 500 MB: asking for it is refused, not attempted.
    let (status, e) = block_on(post(&node.url("/v1/completions"), &json!({"model": QWEN, "prompt": "hi"}).to_string()));
    assert_eq!((status, e["error"]["code"].as_str()), (400, Some("model_too_large")), "{e}");
    let (status, e) = block_on(post(&node.url("/v1/models/load"), &json!({"model": QWEN}).to_string()));
    assert_eq!((status, e["error"]["code"].as_str()), (400, Some("model_too_large")), "{e}");
    let (status, r) = block_on(post(&node.url("/v1/models/load"), &json!({"model": GEMMA}).to_string()));
    assert_eq!((status, r["status"].as_str()), (200, Some("loaded")), "{r}");
    assert_eq!(block_on(get(&node.url("/health"))), (200, json!({"status": "ok"})));
}

#[test]
fn a_model_whose_footprint_exceeds_the_offer_is_refused_though_its_file_would_fit() {
    // Gemma's 253 MB file fits 350 MB; what serving it takes (weights as held, the tied embedding
    // twice, and a 1,024-position cache: about 430 MB) does not, so asking is refused at once.
    let node = Node::start(&["serve", "--memory-limit", "350MB", "--context", "1024"]);
    let source = shoal::engine::model::ModelSource::open(std::path::Path::new(&gemma_path())).expect("gemma opens");
    let needed = shoal::models::footprint(GEMMA, &source, Some(1024)).total_bytes_on(false);
    let file = std::fs::metadata(gemma_path()).unwrap().len();
    assert!(file < 350_000_000 && needed > 350_000_000, "file {file}, footprint {needed}");
    let (status, e) = block_on(post(&node.url("/v1/completions"), &json!({"model": GEMMA, "prompt": "hi", "max_tokens": 1}).to_string()));
    assert_eq!((status, e["error"]["code"].as_str()), (400, Some("model_too_large")), "{e}");
    assert!(e["error"]["message"].as_str().unwrap_or("").contains(&format!("needs {needed} bytes")), "{e}");
}

#[test]
fn bare_shoal_serves_the_embedded_ui_with_content_types() {
    // No subcommand: `shoal [options]` is `shoal serve [options]`.
    let node = Node::start(&[]);
    let web = repo_root().join("web");
    let mut served = 0;
    for entry in std::fs::read_dir(&web).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()) {
        let name = entry.file_name().unwrap().to_string_lossy().into_owned();
        let expected = match entry.extension().and_then(|e| e.to_str()) {
            Some("html") => "text/html",
            Some("js" | "mjs") => "javascript",
            Some("css") => "text/css",
            Some("svg") => "image/svg+xml",
            Some("json") => "application/json",
            Some("md") => "text/markdown",
            _ => continue,
        };
        let (ctype, body) = block_on(async {
            let r = reqwest::get(node.url(&format!("/{name}"))).await.unwrap();
            assert_eq!(r.status(), 200, "/{name}");
            (r.headers()["content-type"].to_str().unwrap().to_string(), r.bytes().await.unwrap())
        });
        assert!(ctype.contains(expected), "/{name}: content-type {ctype}, expected {expected}");
        assert_eq!(body.as_ref(), std::fs::read(&entry).unwrap().as_slice(), "/{name} is the file in web/");
        served += 1;
    }
    assert!(served > 0, "web/ has no files to serve");
    if web.join("index.html").exists() {
        let root = block_on(async { reqwest::get(node.url("/")).await.unwrap().bytes().await.unwrap() });
        assert_eq!(root.as_ref(), std::fs::read(web.join("index.html")).unwrap().as_slice(), "/ serves index.html");
    }
    let missing = block_on(async { reqwest::get(node.url("/no-such-file.js")).await.unwrap().status().as_u16() });
    assert_eq!(missing, 404);
}

#[test]
fn sigterm_ends_open_streams_and_exits_cleanly() {
    let mut node = Node::start(&["serve", "--model", &gemma_path()]);
    let body = block_on(async {
        let mut response = reqwest::Client::new().post(node.url("/v1/completions")).body(long_completion(true)).send().await.unwrap();
        let mut seen = response.chunk().await.unwrap().expect("a first chunk").to_vec();
        let kill = Command::new("kill").args(["-TERM", &node.pid().to_string()]).status().unwrap();
        assert!(kill.success());
        let read_rest = async {
            while let Some(chunk) = response.chunk().await.unwrap_or(None) {
                seen.extend_from_slice(&chunk);
            }
        };
        tokio::time::timeout(Duration::from_secs(10), read_rest).await.expect("the stream ends promptly on SIGTERM");
        String::from_utf8(seen).unwrap()
    });
    let data = sse_data(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let error: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "shutting_down", "{body}");
    let status = node.wait_exit(Duration::from_secs(10));
    assert!(status.success(), "exit status {status}; stderr:\n{}", node.stderr());
}

#[test]
fn a_request_that_waits_past_its_deadline_gets_503() {
    let node = Node::start(&["serve", "--model", &gemma_path(), "--queue-timeout", "2"]);
    block_on(async {
        let client = reqwest::Client::new();
        let mut running = client.post(node.url("/v1/completions")).body(long_completion(true)).send().await.unwrap();
        running.chunk().await.unwrap().expect("the first request is generating");
        let started = Instant::now();
        let expired = client.post(node.url("/v1/completions")).body(long_completion(false)).send().await.unwrap();
        assert_eq!(expired.status(), 503);
        assert!(expired.headers().contains_key("retry-after"));
        assert!(started.elapsed() >= Duration::from_secs(2) && started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
        let e: Value = expired.json().await.unwrap();
        assert_eq!(e["error"]["code"], "queue_timeout", "{e}");
        assert_eq!(node.metric("shoal_queue_expired_total"), 1.0);
    });
}

#[test]
fn a_request_naming_another_local_model_switches_to_it() {
    let node = Node::start(&["serve", "--model", &gemma_path()]);
    for (model, layers) in [(QWEN, 28), (GEMMA, 18)] {
        let (status, r) = block_on(post(&node.url("/v1/completions"), &json!({"model": model, "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0}).to_string()));
        assert_eq!((status, r["model"].as_str()), (200, Some(model)), "{r}");
        let (_, c) = block_on(get(&node.url("/v1/cluster")));
        assert_eq!(c["nodes"][0]["models"], json!([model]), "one model at a time: {c}");
        assert_eq!(c["plans"][0]["stages"][0]["end"], layers, "{c}");
    }
    // Asking to load the model that is loaded is a no-op.
    let (status, r) = block_on(post(&node.url("/v1/models/load"), &json!({"model": GEMMA}).to_string()));
    assert_eq!((status, r["status"].as_str()), (200, Some("loaded")), "{r}");
}
