//! The HTTP listener of `ebtrace serve --http ADDR`: `/metrics` in the
//! Prometheus text format; anything else gets 404 and the
//! list of what is there.

use std::{future::Future, sync::Arc};

use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::IntoResponse,
    routing::get,
};

use super::{Metrics, exposition};
use crate::server::sessions::HubHandle;

#[derive(Clone)]
struct Shared {
    metrics: Arc<Metrics>,
    hub: HubHandle,
}

/// Serves until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    hub: HubHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(scrape))
        .fallback(not_found)
        .with_state(Shared { metrics, hub });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn scrape(State(shared): State<Shared>) -> impl IntoResponse {
    // The hub knows the watched processes; a server shutting down has none.
    let targets = shared.hub.targets().await.unwrap_or_default();
    let metrics = Arc::clone(&shared.metrics);
    // Reading /proc for every thread is blocking work.
    let body = tokio::task::spawn_blocking(move || metrics.render(&targets))
        .await
        .unwrap_or_default();
    ([(header::CONTENT_TYPE, exposition::CONTENT_TYPE)], body)
}

async fn not_found() -> impl IntoResponse {
    (
        StatusCode::NOT_FOUND,
        "not found; this server has /metrics (Prometheus)\n",
    )
}
