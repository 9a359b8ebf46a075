//! The node's Prometheus metrics, in a registry of its own (no globals), rendered as text at
//! `/metrics`: requests by endpoint and status, errors by code, tokens, generations by outcome,
//! the wait queue (depth, rejected, abandoned, expired), time to first token and last tok/s.
//! It does not decide anything from the figures; the scheduler and handlers only record.

use prometheus::{Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};

/// Every metric the API records. Cheap to share behind an `Arc`; all updates are atomic.
pub struct Metrics {
    registry: Registry,
    /// HTTP requests by route and status code.
    pub requests: IntCounterVec,
    /// Error responses (and in-stream error events) by error code.
    pub errors: IntCounterVec,
    pub prompt_tokens: IntCounter,
    pub completion_tokens: IntCounter,
    /// Generations that ran on the engine, by outcome: stop, length, cancelled, error.
    pub generations: IntCounterVec,
    /// Requests refused because the queue was full.
    pub queue_rejected: IntCounter,
    /// Requests whose client went away while they waited in the queue.
    pub queue_abandoned: IntCounter,
    /// Requests that waited past their deadline.
    pub queue_expired: IntCounter,
    /// Requests waiting for the engine now.
    pub queue_depth: IntGauge,
    /// Generations running on the engine now (0 or 1).
    pub running: IntGauge,
    /// Seconds from a request's arrival to its first token (queue wait included).
    pub time_to_first_token: Histogram,
    /// Decode speed of the last finished generation.
    pub decode_tok_s: Gauge,
    /// Prefill speed of the last finished generation.
    pub prefill_tok_s: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new_custom(Some("shoal".into()), None).expect("a static prefix is valid");
        // Registration only fails on a duplicate or malformed name; these are fixed and distinct.
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
            r.register(Box::new(m.clone())).expect("metric names are distinct and valid");
            m
        }
        let counter = |name: &str, help: &str| reg(&registry, IntCounter::new(name, help).expect("valid metric"));
        let counter_vec = |name: &str, help: &str, labels: &[&str]| reg(&registry, IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"));
        let gauge = |name: &str, help: &str| reg(&registry, Gauge::new(name, help).expect("valid metric"));
        let int_gauge = |name: &str, help: &str| reg(&registry, IntGauge::new(name, help).expect("valid metric"));
        let buckets = vec![0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
        Metrics {
            requests: counter_vec("http_requests_total", "HTTP requests by route and status", &["route", "status"]),
            errors: counter_vec("errors_total", "API errors by code", &["code"]),
            prompt_tokens: counter("prompt_tokens_total", "prompt tokens processed"),
            completion_tokens: counter("completion_tokens_total", "tokens generated"),
            generations: counter_vec("generations_total", "generations run on the engine, by outcome", &["outcome"]),
            queue_rejected: counter("queue_rejected_total", "requests refused because the queue was full"),
            queue_abandoned: counter("queue_abandoned_total", "requests whose client left while queued"),
            queue_expired: counter("queue_expired_total", "requests that waited past their deadline"),
            queue_depth: int_gauge("queue_depth", "requests waiting for the engine"),
            running: int_gauge("generations_running", "generations running on the engine"),
            time_to_first_token: reg(&registry, Histogram::with_opts(HistogramOpts::new("time_to_first_token_seconds", "request arrival to first token").buckets(buckets)).expect("valid metric")),
            decode_tok_s: gauge("decode_tokens_per_second", "decode speed of the last generation"),
            prefill_tok_s: gauge("prefill_tokens_per_second", "prefill speed of the last generation"),
            registry,
        }
    }

    /// Counts a finished generation.
    pub fn generation_finished(&self, outcome: &str, usage: Option<&crate::engine::Usage>) {
        self.generations.with_label_values(&[outcome]).inc();
        if let Some(u) = usage {
            self.prompt_tokens.inc_by(u.prompt_tokens as u64);
            self.completion_tokens.inc_by(u.completion_tokens as u64);
            if u.completion_tokens > 1 {
                self.decode_tok_s.set(u.decode_tok_s);
            }
            if u.completion_tokens > 0 {
                self.prefill_tok_s.set(u.prefill_tok_s);
            }
        }
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail on I/O, and our metrics are well-formed.
        TextEncoder::new().encode(&self.registry.gather(), &mut buf).expect("text encoding into memory");
        String::from_utf8(buf).expect("the text encoder writes UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::new();
        m.requests.with_label_values(&["/v1/models", "200"]).inc();
        m.generation_finished("cancelled", None);
        let text = m.render();
        assert!(text.contains("shoal_http_requests_total{route=\"/v1/models\",status=\"200\"} 1"), "{text}");
        assert!(text.contains("shoal_generations_total{outcome=\"cancelled\"} 1"), "{text}");
        assert!(text.contains("# TYPE shoal_queue_depth gauge"), "{text}");
    }
}
