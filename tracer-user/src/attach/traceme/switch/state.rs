//! Where a gate stands, as far as ebtrace is concerned, and the summary
//! line that says so.

/// Where a gate stands, as far as ebtrace is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LevelState {
    /// ebtrace switched it on.
    Enabled {
        /// The value written.
        level: i32,
        /// A killed ebtrace had left it on, and this one took it over.
        adopted: bool,
    },
    /// A profiler session in the process has it on: observed only.
    InProcess {
        /// The value found.
        level: i32,
    },
    /// Another running ebtrace switched it on: observed only.
    OtherEbtrace {
        /// That ebtrace's pid.
        owner: u32,
        /// The value it wrote.
        level: i32,
    },
    /// ebtrace had it on and put the off value back.
    Restored {
        /// The value it had written.
        level: i32,
        /// Put back before the capture ended (`--max-events`).
        early: bool,
    },
    /// Reading or writing it failed.
    Failed {
        /// What failed, and how.
        error: String,
    },
}

impl LevelState {
    /// True while the target records TraceMes at all.
    pub fn recording(&self) -> bool {
        matches!(
            self,
            LevelState::Enabled { .. }
                | LevelState::InProcess { .. }
                | LevelState::OtherEbtrace { .. }
        )
    }

    /// One line for the capture summary on where the gate stands.
    pub fn describe(&self) -> String {
        match self {
            LevelState::Enabled {
                level,
                adopted: false,
            } => {
                format!("level {level} set by ebtrace (no profiler session in the process)")
            }
            LevelState::Enabled {
                level,
                adopted: true,
            } => format!(
                "level {level} left on by an ebtrace that was killed; taken over, will be restored"
            ),
            LevelState::InProcess { level } => {
                format!("a profiler session in the process has level {level}; observing only")
            }
            LevelState::OtherEbtrace { owner, level } => {
                format!("another ebtrace (pid {owner}) set level {level}; observing only")
            }
            LevelState::Restored {
                level,
                early: false,
            } => {
                format!("level {level} set by ebtrace, restored to -1")
            }
            LevelState::Restored { level, early: true } => {
                format!("level {level} set by ebtrace, restored to -1 early (--max-events reached)")
            }
            LevelState::Failed { error } => format!("trace level not switched: {error}"),
        }
    }
}
