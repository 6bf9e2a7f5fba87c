//! Python frames in the stacks of traced processes: each target that runs
//! a CPython ebtrace reads is put in the map the stack programs look in,
//! with where its interpreter keeps its threads' frames.

use crate::{error::Result, procfs::TargetProcess, symbols::python::runtime::PythonRuntime};

use super::ProbeSet;

/// Has the stack programs read the Python frames of those of `targets`
/// that run CPython; returns a line for each that does, saying whether its
/// frames are read or why not.
pub fn read_python_frames(probe: &mut ProbeSet, targets: &[TargetProcess]) -> Result<Vec<String>> {
    let mut notes = Vec::new();
    for t in targets {
        match PythonRuntime::find(t.pid) {
            Ok(None) => {}
            Ok(Some(runtime)) => {
                probe.set_python(t.pid, Some(runtime.walk()))?;
                let object = runtime.object.rsplit('/').next().unwrap_or_default();
                notes.push(format!(
                    "pid {} ({}): Python {} ({object}): Python frames in its stacks",
                    t.pid, t.name, runtime.version
                ));
            }
            Err(why) => notes.push(format!(
                "pid {} ({}): {why}: native stacks only",
                t.pid, t.name
            )),
        }
    }
    Ok(notes)
}
