//! The gate in the processes forked from a target while it was on: they
//! inherited it switched on, and nothing else would switch it off.

use super::super::cell::Cell;

/// Puts the gate `cell` back to `off` in the processes forked from its
/// process since `since` (clock ticks since boot) that inherited it `on`
/// and still hold that value (no session of theirs switched it: they would
/// record into their memory for ever), and still run the same code at the
/// gate's address (one that called exec since has other code there).
/// Returns their pids.
pub fn put_back_in_children(cell: Cell, since: u64, on: i64, off: i64) -> Vec<u32> {
    let parent = cell.pid;
    let Some(ours) = crate::procfs::mapping_at(parent, cell.address) else {
        return Vec::new();
    };
    let mut restored = Vec::new();
    for child in crate::procfs::descendants_since(parent, since) {
        if crate::procfs::mapping_at(child, cell.address).as_ref() != Some(&ours) {
            continue;
        }
        let cell = Cell { pid: child, ..cell };
        if cell.read().ok() == Some(on) && cell.write(off).is_ok() {
            restored.push(child);
        }
    }
    restored
}

/// The line that says in which children of `parent` the gate at `address`
/// was put back to `off`; none if in none.
pub fn describe_children(parent: u32, address: u64, off: i64, children: &[u32]) -> Option<String> {
    (!children.is_empty()).then(|| {
        format!(
            "pid {parent}: the TraceMe gate at {address:#x} was on when it forked; put back to \
             {off} in its child{} {}",
            if children.len() == 1 { "" } else { "ren" },
            children
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}
