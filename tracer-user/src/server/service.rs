//! The `tensorflow.ProfilerService` methods. Each one validates its
//! request, asks the session hub (the one owner of probes and sessions),
//! and maps every failure to a precise gRPC status.

use std::{sync::Arc, time::Duration};

use ebtrace_proto::tensorflow::{
    ContinuousProfilingResponse, GetSnapshotRequest, MonitorRequest, MonitorResponse,
    ProfileRequest, ProfileResponse, ProfilerServiceMonitorResult, StopContinuousProfilingRequest,
    StopContinuousProfilingResponse, TerminateRequest, TerminateResponse,
    profiler_service_monitor_result::ResponseType, profiler_service_server::ProfilerService,
};
use tonic::{Request, Response, Status};

use super::{
    admission::{Admission, NotAdmitted, Slot, Work},
    caller::{Authority, Caller, Refusal, Scope},
    monitor,
    sessions::{HubHandle, SessionError},
    validate::{self, Limits},
    write_guard::WriteGuard,
};
use crate::{clock, metrics::Metrics, procfs::TargetProcess};

/// TensorFlow's gRPC ProfilerService, answered by the session hub.
pub struct ProfilerServer {
    /// Where requests go.
    pub hub: HubHandle,
    /// What a request may ask for.
    pub limits: Limits,
    /// The directory the server may save traces under, if any.
    pub guard: Option<Arc<WriteGuard>>,
    /// This machine's name, recorded in traces unless a request overrides it.
    pub hostname: String,
    /// Where refusals are counted.
    pub metrics: Arc<Metrics>,
    /// Who may do what.
    pub authority: Arc<Authority>,
    /// How much work each caller may have in progress.
    pub admission: Arc<Admission>,
}

fn status_of(e: SessionError) -> Status {
    let message = e.to_string();
    match e {
        SessionError::Busy { .. } => Status::resource_exhausted(message),
        SessionError::PidNotWatched { .. } => Status::invalid_argument(message),
        SessionError::NothingWatched(_) | SessionError::RecorderOff | SessionError::NoRoom(_) => {
            Status::failed_precondition(message)
        }
        SessionError::Attach(_) | SessionError::Response(_) => Status::internal(message),
        SessionError::ShuttingDown => Status::unavailable(message),
    }
}

impl ProfilerServer {
    /// A `ProfileRequest` checked against this server's limits.
    fn checked(
        &self,
        request: &Request<ProfileRequest>,
        caller: &Caller,
    ) -> Result<validate::SessionSpec, Status> {
        validate::profile_request(
            request.get_ref(),
            &self.limits,
            self.guard.as_deref(),
            clock::realtime_ns(),
            &self.hostname,
            caller.to_string(),
        )
        .map_err(|e| Status::invalid_argument(e.to_string()))
    }

    /// A refused request, counted and logged: `PERMISSION_DENIED` with the
    /// rule's line.
    fn refused(&self, caller: &Caller, method: &str, why: Refusal) -> Status {
        why.count(&self.metrics, caller, method);
        Status::permission_denied(why.to_string())
    }

    /// The processes `caller` may have `spec` record (`scope`), set on it;
    /// refused where there are none.
    async fn restrict(
        &self,
        caller: &Caller,
        method: &str,
        scope: Scope,
        spec: &mut validate::SessionSpec,
    ) -> Result<(), Status> {
        let targets = self.hub.targets().map_err(status_of)?;
        let allowed = caller
            .allowed_pids(scope, &targets, spec.pids.as_ref())
            .map_err(|why| self.refused(caller, method, why))?;
        if allowed.is_some() {
            spec.pids = allowed;
        }
        Ok(())
    }

    /// The watched processes, refused unless `caller` may read every one.
    async fn readable_targets(
        &self,
        caller: &Caller,
        method: &str,
    ) -> Result<Vec<TargetProcess>, Status> {
        let targets = self.hub.targets().map_err(status_of)?;
        caller
            .may_read_all(&targets)
            .map_err(|why| self.refused(caller, method, why))?;
        Ok(targets)
    }

    /// A place for `work` of `caller`'s; `RESOURCE_EXHAUSTED` where there
    /// is none, counted.
    async fn admit(&self, caller: &Caller, work: Work) -> Result<Slot, Status> {
        self.admission.admit(caller, work).await.map_err(|why| {
            not_admitted(&self.metrics, caller, &why);
            Status::resource_exhausted(why.to_string())
        })
    }

    /// Refused unless `caller` may change the server for everyone.
    fn may_control(&self, caller: &Caller, method: &str) -> Result<(), Status> {
        caller
            .may_control()
            .map_err(|why| self.refused(caller, method, why))
    }
}

/// Counts and logs work not admitted, as both listeners do.
pub fn not_admitted(metrics: &Metrics, caller: &Caller, why: &NotAdmitted) {
    metrics
        .server
        .requests_not_admitted
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    eprintln!("ebtrace: not admitted, from {caller}: {why}");
}

#[tonic::async_trait]
impl ProfilerService for ProfilerServer {
    async fn profile(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let caller = self.authority.caller_of(&request);
        let mut spec = self.checked(&request, &caller)?;
        spec.owner = caller.identity();
        self.restrict(&caller, "Profile", Scope::Capture, &mut spec)
            .await?;
        let slot = self.admit(&caller, Work::Capture).await?;
        let response = self.hub.profile(spec, slot).await.map_err(status_of)?;
        Ok(Response::new(response))
    }

    async fn terminate(
        &self,
        request: Request<TerminateRequest>,
    ) -> Result<Response<TerminateResponse>, Status> {
        // A caller may end its own captures; others' only with control.
        let caller = self.authority.caller_of(&request);
        let owner = caller.may_control().err().map(|_| caller.identity());
        let session_id = request.into_inner().session_id;
        match self.hub.terminate(session_id.clone(), owner.clone()).await {
            Ok(0) => Err(Status::not_found(match owner {
                None => format!("no capture with session_id {session_id:?} is in progress"),
                Some(owner) => format!(
                    "no capture of {owner}'s with session_id {session_id:?} is in progress \
                     (only root, and those --policy grants \"control\", may end others')"
                ),
            })),
            Ok(_) => Ok(Response::new(TerminateResponse {})),
            Err(e) => Err(status_of(e)),
        }
    }

    async fn monitor(
        &self,
        request: Request<MonitorRequest>,
    ) -> Result<Response<MonitorResponse>, Status> {
        let targets = self
            .readable_targets(&self.authority.caller_of(&request), "Monitor")
            .await?;
        let req = request.into_inner();
        if req.duration_ms == 0 {
            return Err(Status::invalid_argument(
                "MonitorRequest.duration_ms is 0: set the window to summarize, in milliseconds",
            ));
        }
        let window = Duration::from_millis(req.duration_ms);
        if window > self.limits.max_duration {
            return Err(Status::invalid_argument(format!(
                "MonitorRequest.duration_ms {} is above this server's limit of {} ms \
                 (ebtrace serve --max-duration)",
                req.duration_ms,
                self.limits.max_duration.as_millis()
            )));
        }
        let before = monitor::read(&targets);
        tokio::time::sleep(window).await;
        let after = monitor::read(&targets);
        let samples: Vec<monitor::Sample> = targets
            .into_iter()
            .zip(before.into_iter().zip(after))
            .map(|(t, (before, after))| monitor::Sample {
                pid: t.pid,
                name: t.name,
                before,
                after,
            })
            .collect();
        let header = req.timestamp.then(|| {
            chrono::Local::now()
                .format("%Y-%m-%d %H:%M:%S%.3f %z")
                .to_string()
        });
        Ok(Response::new(MonitorResponse {
            data: monitor::render(&samples, window, header),
            monitor_result: Some(ProfilerServiceMonitorResult {
                response_type: ResponseType::EmptyResult as i32,
                ..Default::default()
            }),
        }))
    }

    async fn start_continuous_profiling(
        &self,
        request: Request<ProfileRequest>,
    ) -> Result<Response<ContinuousProfilingResponse>, Status> {
        let caller = self.authority.caller_of(&request);
        self.may_control(&caller, "StartContinuousProfiling")?;
        let spec = self.checked(&request, &caller)?;
        self.hub.start_recorder(spec).await.map_err(status_of)?;
        Ok(Response::new(ContinuousProfilingResponse {}))
    }

    async fn stop_continuous_profiling(
        &self,
        request: Request<StopContinuousProfilingRequest>,
    ) -> Result<Response<StopContinuousProfilingResponse>, Status> {
        self.may_control(
            &self.authority.caller_of(&request),
            "StopContinuousProfiling",
        )?;
        self.hub.stop_recorder().await.map_err(status_of)?;
        Ok(Response::new(StopContinuousProfilingResponse {}))
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<ProfileResponse>, Status> {
        let caller = self.authority.caller_of(&request);
        self.readable_targets(&caller, "GetSnapshot").await?;
        let client = caller.to_string();
        let id = request.into_inner().snapshot_session_id;
        let id = if id.is_empty() { "snapshot".into() } else { id };
        let slot = self.admit(&caller, Work::Snapshot).await?;
        let response = self
            .hub
            .snapshot(id, client, slot)
            .await
            .map_err(status_of)?;
        Ok(Response::new(response))
    }
}
