//! The HTTP face of a node, on one port: the OpenAI dialect (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`), shoal's own `/v1/cluster`, `/health`, `/metrics`, and the
//! web UI embedded from `web/`. `Server::bind` then `Server::run` under a shutdown token.
//! It is the only layer that knows HTTP or JSON; it never runs model code itself (the swarm
//! does, on this node's stage thread or on other nodes). See docs/api.md for the contract.

pub mod assets;
pub mod error;
pub mod generation;
pub mod metrics;
pub mod node_view;
pub mod pulls;
pub mod request;
pub mod scheduler;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::engine::probe::MachineProfile;
use crate::swarm::SwarmHandle;
use crate::models::store::{any_model_path, inspect};
use crate::models::{LocalModel, Progress, Store};
use error::ApiError;
use metrics::Metrics;
use scheduler::{SchedulerConfig, SchedulerHandle};

/// Everything `serve` needs, validated by the binary.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// A model to load at start.
    pub preload: Option<PathBuf>,
    /// Caps the memory this node offers, in bytes.
    pub memory_limit: Option<u64>,
    /// When set, every `/v1/*` request needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Caps each model's context window (tokens).
    pub context: Option<usize>,
    pub max_queue: usize,
    pub queue_timeout: Duration,
    /// How long a graceful shutdown may take before tasks are aborted.
    pub shutdown_timeout: Duration,
}

/// Who this node is, as the cluster view shows it.
#[derive(Debug, Clone)]
pub struct NodeInfo {
    pub id: String,
    pub name: String,
    /// e.g. "x86_64 2 cores".
    pub device: String,
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    /// `--model` names no model file or directory.
    #[error("{0}: not a model file or directory")]
    NoModel(PathBuf),
    /// The HTTP server failed.
    #[error("http server: {0}")]
    Http(std::io::Error),
}

/// Shared by every handler.
pub struct App {
    pub(crate) node: NodeInfo,
    pub(crate) config: ApiConfig,
    pub(crate) scheduler: SchedulerHandle,
    /// The models on disk, shared with the peer-copy server (`models::peer::serve`).
    pub(crate) store: Arc<Store>,
    /// Downloads and peer copies in progress, shown in `/v1/cluster` `downloads`.
    pub(crate) progress: Progress,
    /// Names being pulled through `/v1/models/pull` (a second request joins the first).
    pub(crate) pulls: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Cancelled when the server stops: ends running pulls (their partial files stay).
    pub(crate) pull_cancel: CancellationToken,
    /// The swarm's network, once attached: pulls copy from connected peers before the hub.
    pub(crate) net: std::sync::Mutex<Option<crate::net::NetHandle>>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) machine: MachineProfile,
    pub(crate) addresses: Vec<String>,
    pub(crate) swarm: SwarmHandle,
}

impl App {
    /// The model a request's `model` field names: absent means the loaded one; the loaded
    /// model's id, or any local id for the same file, means it; another local id means that
    /// model (loaded before the request runs); anything else is 404.
    pub(crate) async fn resolve(self: &Arc<Self>, name: Option<&str>) -> Result<LocalModel, ApiError> {
        let state = self.scheduler.state();
        let current = state.loaded.as_ref().map(|l| &l.model).or(state.loading.as_ref());
        let Some(name) = name.filter(|n| !n.is_empty()) else { return current.cloned().ok_or(ApiError::ModelRequired) };
        if let Some(m) = current.filter(|m| m.id == name) {
            return Ok(m.clone());
        }
        let app = self.clone();
        let local = tokio::task::spawn_blocking(move || app.store.scan()).await.unwrap_or_default();
        match local.iter().find(|m| m.id == name) {
            Some(m) if current.is_some_and(|c| c.path == m.path) => Ok(current.cloned().unwrap_or_else(|| m.clone())),
            Some(m) => self.check_fits(m).await.map(|_| m.clone()),
            None => {
                let mut ids: Vec<&str> = current.iter().map(|m| m.id.as_str()).chain(local.iter().map(|m| m.id.as_str())).collect();
                ids.dedup();
                Err(ApiError::ModelNotFound { model: name.to_string(), available: if ids.is_empty() { "none".into() } else { ids.join(", ") } })
            }
        }
    }
}

/// The local model files this node knows (data dir, `SHOAL_MODELS`, the fetch cache, and
/// `--model`), and `--model` itself, checked to be a model.
pub fn open_store(config: &ApiConfig) -> Result<(Arc<Store>, Option<LocalModel>), ServeError> {
    let preload = match &config.preload {
        Some(path) => Some(inspect(path).or_else(|| any_model_path(path)).ok_or_else(|| ServeError::NoModel(path.clone()))?),
        None => None,
    };
    Ok((Arc::new(Store::open(&config.data_dir, preload.iter().map(|m| m.path.clone()).collect()).with_context_limit(config.context)), preload))
}

/// What the node made before the server: its local models, its measured profile, its swarm.
pub struct ServerParts {
    pub store: Arc<Store>,
    /// `--model`, checked to be a model.
    pub preload: Option<LocalModel>,
    pub machine: MachineProfile,
    /// Runs every generation.
    pub swarm: SwarmHandle,
}

/// A bound, ready server.
pub struct Server {
    listener: TcpListener,
    app: Arc<App>,
    scheduler_task: tokio::task::JoinHandle<()>,
    /// Cancelled (by `run`) when the root token is: stops the scheduler and its engine.
    scheduler_token: CancellationToken,
}

impl Server {
    /// Binds the port (the API listener comes first: the swarm's advert carries its address).
    pub async fn bind_listener(listen: SocketAddr) -> Result<TcpListener, ServeError> {
        TcpListener::bind(listen).await.map_err(|source| ServeError::Bind { addr: listen, source })
    }

    /// The addresses a client can reach `listener` on.
    pub async fn reachable_addresses(listener: &TcpListener) -> Vec<String> {
        let Ok(bound) = listener.local_addr() else { return vec![] };
        tokio::task::spawn_blocking(move || node_view::listen_addresses(bound)).await.unwrap_or_else(|_| vec![bound.to_string()])
    }

    /// Starts the scheduler on a bound listener and queues `--model`'s load.
    pub async fn bind(listener: TcpListener, config: ApiConfig, node: NodeInfo, parts: ServerParts, shutdown: &CancellationToken) -> Result<Server, ServeError> {
        let ServerParts { store, preload, machine, swarm } = parts;
        let metrics = Arc::new(Metrics::new());
        let scheduler_token = shutdown.child_token();
        let scheduler_config = SchedulerConfig { max_queue: config.max_queue, queue_timeout: config.queue_timeout, context_limit: config.context };
        let (scheduler, scheduler_task) = SchedulerHandle::spawn(scheduler_config, swarm.clone(), metrics.clone(), scheduler_token.clone());
        let addresses = Self::reachable_addresses(&listener).await;
        let (progress, pulls, pull_cancel, net) = (Progress::default(), Default::default(), shutdown.child_token(), Default::default());
        let app = Arc::new(App { node, config, scheduler, store, progress, pulls, pull_cancel, net, metrics, machine, addresses, swarm });
        // No size check here: the peers that could hold the model with us may not have joined
        // yet. The swarm places it once they have; until then `/v1/cluster` shows why not.
        if let Some(model) = preload {
            app.scheduler.load(model);
        }
        Ok(Server { listener, app, scheduler_task, scheduler_token })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    pub fn machine(&self) -> MachineProfile {
        self.app.machine
    }

    /// Lets `/v1/models/pull` copy from this network's connected peers before the hub.
    pub fn attach_net(&self, net: crate::net::NetHandle) {
        *self.app.net.lock().unwrap_or_else(|p| p.into_inner()) = Some(net);
    }

    /// The node's download progress registry (`/v1/cluster` `downloads`).
    pub fn progress(&self) -> Progress {
        self.app.progress.clone()
    }

    /// Serves until `shutdown` is cancelled, then closes gracefully within the configured
    /// timeout: the scheduler fails waiting requests with 503 and stops the running one, open
    /// streams end, and whatever is still running after the timeout is aborted.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServeError> {
        use axum::serve::ListenerExt;
        let grace = self.app.config.shutdown_timeout;
        let router = router(self.app);
        // Tokens are written one by one: without TCP_NODELAY each would wait for an ACK.
        let listener = self.listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let http_token = shutdown.child_token();
        let mut tasks = tokio::task::JoinSet::new();
        tasks.spawn(async move { axum::serve(listener, router).with_graceful_shutdown(http_token.cancelled_owned()).await.map_err(ServeError::Http) });
        let scheduler_task = self.scheduler_task;
        tasks.spawn(async move {
            let _ = scheduler_task.await;
            Ok(())
        });
        tokio::select! {
            _ = shutdown.cancelled() => {}
            Some(ended) = tasks.join_next() => {
                // A task that ends before shutdown is a failure: stop the rest.
                shutdown.cancel();
                if let Ok(Err(e)) = ended { return Err(e); }
            }
        }
        self.scheduler_token.cancel();
        let closing = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, closing).await.is_err() {
            tracing::warn!(?grace, "graceful shutdown timed out; aborting open connections");
            tasks.abort_all();
        }
        Ok(())
    }
}

fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/chat/completions", post(generation::chat_completions))
        .route("/completions", post(generation::completions))
        .route("/models", get(node_view::list_models))
        .route("/models/load", post(node_view::load_model))
        .route("/models/pull", post(pulls::pull_model))
        .route("/catalogue", get(pulls::catalogue))
        .route("/models/{id}", get(node_view::get_model))
        .route("/cluster", get(node_view::cluster))
        .fallback(|req: Request| async move { ApiError::NoRoute(req.uri().path().to_string()) })
        .layer(middleware::from_fn_with_state(app.clone(), require_key));
    Router::new()
        .route("/health", get(node_view::health))
        .route("/metrics", get(|State(app): State<Arc<App>>| async move { ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render()) }))
        .nest("/v1", v1)
        .fallback(assets::serve)
        .layer(middleware::from_fn_with_state(app.clone(), count_requests))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| ApiError::Internal("the request handler panicked".into()).into_response()))
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(app)
}

/// With `--api-key`, `/v1/*` needs `Authorization: Bearer <key>`.
async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.config.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes())) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Counts every request by route and status, and every error response by its code.
async fn count_requests(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or_else(|| "other".to_string(), |m| m.as_str().to_string());
    let response = next.run(req).await;
    let status = response.status();
    app.metrics.requests.with_label_values(&[route.as_str(), status.as_str()]).inc();
    if let Some(code) = response.extensions().get::<error::ErrorCode>() {
        app.metrics.errors.with_label_values(&[code.0]).inc();
    } else if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
        app.metrics.errors.with_label_values(&["internal_error"]).inc();
    }
    response
}
