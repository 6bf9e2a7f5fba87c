//! Why the agent in a process did not do what ebtrace asked of it.

use super::inject::InjectError;

/// An agent's failure, as one line for the user.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Loading the agent failed; `listener` says why a listening agent
    /// (one the program was started with) was not used instead.
    #[error("{source}{}", listener.as_ref().map(|l| format!(" ({l})")).unwrap_or_default())]
    Load {
        /// Why the load failed.
        #[source]
        source: InjectError,
        /// Why a listening agent was not used, if the program had one.
        listener: Option<String>,
    },
    /// Another capture's agent is in the process now.
    #[error("another agent is in pid {pid} now (another capture's)")]
    Busy {
        /// The target process.
        pid: u32,
    },
    /// The agent could not do it, in its own words.
    #[error("{0}")]
    Refused(String),
    /// The agent answered `request` with a frame that does not answer it.
    #[error("the agent answered {request} with frame {kind}")]
    OutOfTurn {
        /// The request sent.
        request: &'static str,
        /// The kind of the frame that came back.
        kind: u32,
    },
    /// The agent's answer broke the protocol.
    #[error("the agent in pid {pid} sent {what}")]
    Malformed {
        /// The target process.
        pid: u32,
        /// What was wrong with the answer.
        what: &'static str,
    },
    /// The control socket failed, or an answer passed its bounds (see
    /// `channel`): the session ends.
    #[error("{0}")]
    Channel(String),
    /// An earlier request was not answered: no later answer can be told
    /// apart from its.
    #[error("an earlier request went unanswered")]
    Unanswered,
    /// The agent did not acknowledge its shutdown, so it was left loaded.
    #[error(
        "the agent did not say goodbye ({why}), so it was left loaded: it stops once the \
         program lets its thread run, and the next ebtrace on pid {pid} takes it out"
    )]
    LeftLoaded {
        /// The target process.
        pid: u32,
        /// Why the shutdown was not acknowledged.
        why: Box<AgentError>,
    },
    /// Taking out an agent loaded for one question failed.
    #[error("taking the agent out: {0}")]
    TakeOut(#[source] Box<AgentError>),
    /// Taking the agent out failed, and so did the second try.
    #[error("{first}; and again: {again}")]
    NotTakenOut {
        /// Why the first try failed.
        first: InjectError,
        /// Why the second try failed.
        #[source]
        again: InjectError,
    },
}

impl AgentError {
    /// The agent's own words from a `FAILED` (or failing) answer.
    pub fn refused(payload: &[u8]) -> Self {
        AgentError::Refused(String::from_utf8_lossy(payload).into_owned())
    }
}
