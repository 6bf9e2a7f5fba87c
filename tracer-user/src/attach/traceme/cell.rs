//! A gate in a target's memory, read and written through
//! `/proc/PID/mem`.

use std::io;

use crate::procfs;

/// A gate in a target's memory: an aligned integer of `width` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cell {
    /// The target process.
    pub pid: u32,
    /// The gate's address in the target.
    pub address: u64,
    /// 4 for `std::atomic<int>`, 1 for `std::atomic<bool>`.
    pub width: u8,
}

impl Cell {
    /// `g_trace_level` (an `std::atomic<int>`).
    pub fn trace_level(pid: u32, address: u64) -> Cell {
        Cell {
            pid,
            address,
            width: 4,
        }
    }

    /// A boolean gate (an `std::atomic<bool>`).
    pub fn flag(pid: u32, address: u64) -> Cell {
        Cell {
            pid,
            address,
            width: 1,
        }
    }

    /// Reads the value (sign-extended for 4 bytes, 0/1 for a bool).
    pub fn read(&self) -> io::Result<i64> {
        match self.width {
            1 => {
                let mut b = [0u8; 1];
                procfs::read_memory(self.pid, self.address, &mut b)?;
                Ok(i64::from(b[0]))
            }
            _ => {
                let mut b = [0u8; 4];
                procfs::read_memory(self.pid, self.address, &mut b)?;
                Ok(i64::from(i32::from_ne_bytes(b)))
            }
        }
    }

    /// Writes the value in one aligned store.
    pub fn write(&self, value: i64) -> io::Result<()> {
        let bytes4 = (value as i32).to_ne_bytes();
        let bytes: &[u8] = match self.width {
            1 => &[value as u8],
            _ => &bytes4,
        };
        let n = procfs::write_memory(self.pid, self.address, bytes)?;
        if n != bytes.len() {
            return Err(io::Error::other(format!(
                "short write ({n} of {} bytes)",
                bytes.len()
            )));
        }
        Ok(())
    }
}
