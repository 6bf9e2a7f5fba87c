//! The callbacks PyTorch calls (through the [`Trampoline`]) at each start
//! and end of a RecordFunction, and what they read: they never block,
//! never allocate and cannot fail, and write into the [`region`] only
//! while a recording has one.

use core::{
    ffi::{c_char, c_void},
    sync::atomic::{AtomicPtr, AtomicU32, AtomicUsize, Ordering},
};

use super::{
    names,
    region::{self, name_slots},
    shapes,
    trampoline::Trampoline,
};
use crate::{
    op_records::{
        self, NO_NAME, NO_SEQUENCE, OpRecord, SCOPE_BACKWARD_FUNCTION, SCOPE_FUNCTION, SCOPE_USER,
    },
    sys,
};

/// The region the callbacks write into while a recording runs.
static REGION: AtomicPtr<u8> = AtomicPtr::new(core::ptr::null_mut());
/// `const char* at::RecordFunction::name() const`.
static NAME_FN: AtomicUsize = AtomicUsize::new(0);
/// Where a RecordFunction keeps its sequence number (0: not read).
static SEQUENCE_AT: AtomicUsize = AtomicUsize::new(0);
/// PyTorch's undefined tensor, while ATen ops' input shapes are read (0:
/// they are not).
static UNDEFINED_TENSOR: AtomicUsize = AtomicUsize::new(0);
/// The pthread key holding each thread's tid, plus one (0: none).
static TID_KEY: AtomicU32 = AtomicU32::new(0);

type NameOf = unsafe extern "C" fn(*const c_void) -> *const c_char;

/// What the callbacks read of a RecordFunction beyond its name.
#[derive(Clone, Copy)]
pub(super) struct Seen {
    /// Where it keeps its sequence number (0: not read).
    pub(super) sequence_at: usize,
    /// PyTorch's undefined tensor, if input shapes are read (else 0).
    pub(super) undefined_tensor: usize,
}

/// Maps a region and a pthread key, points the callbacks at them (with
/// `name_of`, PyTorch's `RecordFunction::name`, and what else they read,
/// `seen`) and the trampoline at the callbacks; `None` if there is no
/// memory or key.
pub(super) fn install(
    trampoline: &Trampoline,
    name_of: usize,
    seen: Seen,
) -> Option<(*mut u8, sys::PthreadKey)> {
    let mut key: sys::PthreadKey = 0;
    // SAFETY: a valid out pointer; no destructor (the values are tids).
    if unsafe { sys::pthread_key_create(&mut key, None) } != 0 {
        return None;
    }
    let Some(region) = region::map() else {
        // SAFETY: the key made above, used by no one yet.
        unsafe { sys::pthread_key_delete(key) };
        return None;
    };
    NAME_FN.store(name_of, Ordering::Release);
    SEQUENCE_AT.store(seen.sequence_at, Ordering::Release);
    UNDEFINED_TENSOR.store(seen.undefined_tensor, Ordering::Release);
    TID_KEY.store(key + 1, Ordering::Release);
    REGION.store(region, Ordering::Release);
    trampoline.fill(
        [
            on_start::<SCOPE_FUNCTION> as *const () as usize,
            on_start::<SCOPE_BACKWARD_FUNCTION> as *const () as usize,
            on_start::<SCOPE_USER> as *const () as usize,
        ],
        on_end as *const () as usize,
    );
    Some((region, key))
}

/// Points the callbacks away from the region: a call from now on records
/// nothing (those running may still finish writing).
pub(super) fn stop_writing() {
    REGION.store(core::ptr::null_mut(), Ordering::Release);
}

/// Forgets the pthread key, about to be deleted.
pub(super) fn forget_tid_key() {
    TID_KEY.store(0, Ordering::Release);
}

/// The calling thread's kernel tid, kept in the pthread key after the
/// first ask.
fn tid() -> u32 {
    let key = TID_KEY.load(Ordering::Acquire);
    if key == 0 {
        return 0;
    }
    let key = key - 1;
    // SAFETY: a key that exists while callbacks run.
    let kept = unsafe { sys::pthread_getspecific(key) } as usize;
    if kept != 0 {
        return kept as u32;
    }
    // SAFETY: gettid takes nothing and cannot fail.
    let tid = unsafe { sys::syscall(sys::SYS_GETTID) } as u32;
    // SAFETY: as above; the value is an integer, never dereferenced.
    unsafe { sys::pthread_setspecific(key, tid as usize as *const c_void) };
    tid
}

/// Start callback for RecordFunctions of `SCOPE`, called by the trampoline
/// as PyTorch calls a `std::unique_ptr<ObserverContext>
/// (*)(const RecordFunction&)`: `ret` is where the (empty) pointer goes.
extern "C" fn on_start<const SCOPE: u32>(
    ret: *mut *mut c_void,
    record_function: *const c_void,
) -> *mut *mut c_void {
    let ts_ns = sys::monotonic_ns();
    // SAFETY: PyTorch passes room for the returned pointer.
    unsafe { ret.write(core::ptr::null_mut()) };
    let region = REGION.load(Ordering::Acquire);
    if region.is_null() {
        return ret;
    }
    let name_of = NAME_FN.load(Ordering::Acquire);
    let name_id = if name_of == 0 {
        NO_NAME
    } else {
        // SAFETY: `at::RecordFunction::name() const`, on the RecordFunction
        // PyTorch passed; it returns a C string that lives through the call.
        let name = unsafe { core::mem::transmute::<usize, NameOf>(name_of)(record_function) };
        // SAFETY: as above; `region` is live while a callback runs.
        unsafe { names::intern(name_slots(region), region, name) }
    };
    let sequence_at = SEQUENCE_AT.load(Ordering::Acquire);
    let sequence = match sequence_at {
        0 => NO_SEQUENCE,
        // SAFETY: the RecordFunction PyTorch passed, whose `sequence_nr_`
        // lies at `at` (see `layout`); `before()` set it ahead of this call.
        at => unsafe {
            (record_function as *const u8)
                .add(at)
                .cast::<i64>()
                .read_unaligned()
        },
    };
    let undefined = UNDEFINED_TENSOR.load(Ordering::Acquire);
    let shapes = if SCOPE != SCOPE_FUNCTION || undefined == 0 || sequence_at == 0 {
        NO_NAME
    } else {
        // SAFETY: `inputs_`, an `ArrayRef` (pointer, length), follows the
        // sequence number (see `layout`); the arguments live through the
        // start callback, which PyTorch called with them boxed.
        unsafe {
            let inputs = (record_function as *const u8).add(sequence_at + 8);
            let args = inputs.cast::<*const u8>().read_unaligned();
            let len = inputs.add(8).cast::<usize>().read_unaligned();
            match shapes::write(args, len, undefined).bytes() {
                Some(text) => names::intern_bytes(name_slots(region), region, text),
                None => NO_NAME,
            }
        }
    };
    region::write(
        region,
        OpRecord {
            ts_ns,
            record_function: record_function as u64,
            tid: tid(),
            what: op_records::start_what(SCOPE, name_id),
            sequence,
            shapes,
            reserved: 0,
        },
    );
    ret
}

/// End callback: `void (*)(const RecordFunction&, ObserverContext*)`.
extern "C" fn on_end(record_function: *const c_void, _context: *mut c_void) {
    let ts_ns = sys::monotonic_ns();
    let region = REGION.load(Ordering::Acquire);
    if region.is_null() {
        return;
    }
    region::write(
        region,
        OpRecord {
            ts_ns,
            record_function: record_function as u64,
            tid: tid(),
            what: op_records::END,
            sequence: NO_SEQUENCE,
            shapes: NO_NAME,
            reserved: 0,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::region::build_frame;
    use super::*;
    use crate::op_records::{NO_NAME, OpsHeader};

    const NAMES: [&core::ffi::CStr; 3] = [c"aten::addmm", c"aten::mm", c"train_step"];

    /// Where the stand-in RecordFunctions keep their sequence number.
    const SEQUENCE_AT: usize = 200;

    /// Stand-in RecordFunctions: `RECORD_FUNCTIONS[i]` is named `NAMES[i]`
    /// and numbered `i + 40` (the third, a user scope, -1: none).
    static RECORD_FUNCTIONS: [[i64; 32]; 3] = {
        let mut r = [[0; 32]; 3];
        r[0][SEQUENCE_AT / 8] = 40;
        r[1][SEQUENCE_AT / 8] = 41;
        r[2][SEQUENCE_AT / 8] = -1;
        r
    };

    fn record_function(i: usize) -> *const c_void {
        RECORD_FUNCTIONS[i].as_ptr().cast()
    }

    /// A stand-in for `RecordFunction::name`.
    extern "C" fn name_of(record_function: *const c_void) -> *const c_char {
        let base = RECORD_FUNCTIONS.as_ptr() as usize;
        let i = (record_function as usize).wrapping_sub(base) / size_of::<[i64; 32]>();
        NAMES[i.min(NAMES.len() - 1)].as_ptr()
    }

    type Start = extern "C" fn(*mut *mut c_void, *const c_void) -> *mut *mut c_void;
    type End = extern "C" fn(*const c_void, *mut c_void);

    /// Calls go through the trampoline's entries as PyTorch calls them;
    /// the frame holds each start and end with its name and each start
    /// with its sequence number, and once the
    /// slots are emptied a call records nothing and returns an empty
    /// pointer. (One test: the trampoline and the region are the process's.)
    #[test]
    fn calls_through_the_trampoline_are_recorded_and_stop_when_emptied() {
        let trampoline = Trampoline::get().expect("a trampoline");
        let name_of = name_of as *const () as usize;
        let seen = Seen {
            sequence_at: SEQUENCE_AT,
            undefined_tensor: 0,
        };
        let (region, key) = install(&trampoline, name_of, seen).unwrap();
        // SAFETY: the trampoline's entries, with PyTorch's signatures.
        let (start, end): (Start, End) = unsafe {
            (
                core::mem::transmute::<usize, Start>(trampoline.start[0]),
                core::mem::transmute::<usize, End>(trampoline.end),
            )
        };
        // SAFETY: as above.
        let user: Start = unsafe { core::mem::transmute::<usize, Start>(trampoline.start[2]) };
        let pairs = 300_000usize;
        let began = std::time::Instant::now();
        for i in 0..pairs {
            let mut ret: *mut c_void = core::ptr::dangling_mut();
            let rf = record_function(i % 2);
            let slot: *mut *mut c_void = &mut ret;
            let back = start(slot, rf);
            assert!(ret.is_null() && core::ptr::eq(back, slot));
            end(rf, core::ptr::null_mut());
        }
        let took = began.elapsed();
        eprintln!(
            "{:.0} ns a start and end through the trampoline",
            took.as_nanos() as f64 / pairs as f64
        );
        let mut ret = core::ptr::null_mut();
        user(&mut ret, record_function(2));
        end(record_function(2), core::ptr::null_mut());

        trampoline.empty_and_drain();
        REGION.store(core::ptr::null_mut(), Ordering::Release);
        let mut ret: *mut c_void = core::ptr::dangling_mut();
        start(&mut ret, core::ptr::null());
        end(core::ptr::null(), core::ptr::null_mut());
        assert!(ret.is_null());

        // SAFETY: nothing writes into the region any more.
        let frame = unsafe { build_frame(region) };
        let header = OpsHeader::decode(frame).unwrap();
        assert_eq!(header.records as usize, 2 * pairs + 2);
        assert_eq!((header.names, header.dropped, header.names_lost), (3, 0, 0));
        let records_at = frame.len() - header.records as usize * OpRecord::LEN;
        let records: Vec<OpRecord> = frame[records_at..]
            .chunks_exact(OpRecord::LEN)
            .filter_map(OpRecord::decode)
            .collect();
        // SAFETY: gettid takes nothing.
        let tid = unsafe { sys::syscall(sys::SYS_GETTID) } as u32;
        assert!(records.iter().all(|r| r.tid == tid));
        assert_eq!(records[1].what, op_records::END);
        let numbers: Vec<i64> = records[..4].iter().map(|r| r.sequence).collect();
        assert_eq!(numbers, [40, NO_SEQUENCE, 41, NO_SEQUENCE]);
        assert_eq!(records[records.len() - 2].sequence, -1);
        let last_start = records[records.len() - 2].what;
        assert_eq!(last_start >> 24, SCOPE_USER);
        assert_ne!(last_start & 0xff_ffff, NO_NAME);
        assert!(records.windows(2).all(|w| w[0].ts_ns <= w[1].ts_ns));
        // SAFETY: the region and key made above.
        unsafe {
            region::unmap(region);
            sys::pthread_key_delete(key);
        }
    }
}
