//! What identifies a TraceMe recorder in an ELF object: the mangled names
//! of `TraceMeRecorder::Record` and of the gates around it, per namespace
//! (TSL's `tsl::profiler` or TensorFlow's older `tensorflow::profiler`),
//! the byte strings that find them fast, and the C++ string layout its
//! `Event` uses, voted from the names of the functions that take one.
//! [`super::facts`] searches an object with these; [`super::discover`]
//! searches a process.

use memchr::memmem::Finder;

/// The recorder's symbols, per namespace.
pub(super) struct Names {
    pub namespace: &'static str,
    pub record: &'static str,
    pub trace_level: &'static str,
}

pub(super) const NAMESPACES: [Names; 2] = [
    Names {
        namespace: "tsl",
        record: "_ZN3tsl8profiler15TraceMeRecorder6RecordEONS1_5EventE",
        trace_level: "_ZN3tsl8profiler8internal13g_trace_levelE",
    },
    Names {
        namespace: "tensorflow",
        record: "_ZN10tensorflow8profiler15TraceMeRecorder6RecordEONS1_5EventE",
        trace_level: "_ZN10tensorflow8profiler8internal13g_trace_levelE",
    },
];

/// Common to both `Record` names: objects whose string tables lack it are
/// skipped without a symbol pass.
pub(super) const RECORD_NEEDLE: &[u8] = b"15TraceMeRecorder6RecordEONS1_5EventE";

/// `tsl::profiler::internal::g_trace_filter_bitmap`: a TraceMe records only
/// if its filter mask meets it; all ones unless a session set a mask.
pub(super) const FILTER_BITMAP: &str = "_ZN3tsl8profiler8internal21g_trace_filter_bitmapE";

/// `xla::profiler::traceme_enabled`, the Python-level TraceMe gate.
pub(super) const PYTHON_GATE: &str = "_ZN3xla8profiler15traceme_enabledE";
/// `xla::profiler::PythonHookContext::EnableTraceMe(bool)`: where the gate
/// was a Python module variable (TensorFlow up to 2.20).
pub(super) const PYTHON_GATE_IN_PYTHON: &str =
    "_ZN3xla8profiler17PythonHookContext13EnableTraceMeEb";
/// Common to both: objects without it need no symbol pass for the gate.
pub(super) const PYTHON_GATE_NEEDLE: &[u8] = b"_ZN3xla8profiler";

/// How the object's `std::string` (the event name) is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StringLayout {
    /// libstdc++ (C++11 ABI): 32-byte string, `Event` of 48 bytes.
    Libstdcxx,
    /// libc++ default layout (`std::__1`): 24-byte string, `Event` of 40.
    Libcxx,
    /// libc++ alternate layout (ABI v2 or a private ABI namespace such as
    /// libtpu's `std::__u`): 24-byte string, `Event` of 40.
    LibcxxAlternate,
}

impl StringLayout {
    /// The eBPF program that reads events of this layout.
    pub fn program(self) -> &'static str {
        use tracer_common::traceme::names;
        match self {
            StringLayout::Libstdcxx => names::PROGRAM_LIBSTDCXX,
            StringLayout::Libcxx => names::PROGRAM_LIBCXX,
            StringLayout::LibcxxAlternate => names::PROGRAM_LIBCXX_ALTERNATE,
        }
    }

    /// The layout's name, as the summary and the symbol cache spell it.
    pub fn describe(self) -> &'static str {
        match self {
            StringLayout::Libstdcxx => "libstdc++",
            StringLayout::Libcxx => "libc++",
            StringLayout::LibcxxAlternate => "libc++ alternate layout",
        }
    }
}

/// Evidence of the C++ library an object was built with, from the
/// `std::` inline namespaces in its symbol names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutVotes {
    /// `std::__cxx11::` (libstdc++'s C++11 ABI).
    pub libstdcxx: usize,
    /// `std::__1::` or `std::__ndk1::` (libc++, default layout).
    pub libcxx: usize,
    /// `std::__2::`, `std::__u::`, ... (libc++, alternate layout).
    pub libcxx_alternate: usize,
}

/// Enough evidence to stop looking.
const VOTES_NEEDED: usize = 64;

impl LayoutVotes {
    pub(super) fn count(&mut self, name: &[u8], finders: &NamespaceFinders) -> bool {
        let NamespaceFinders { cxx11, libcxx, ndk } = finders;
        if cxx11.find(name).is_some() {
            self.libstdcxx += 1;
        }
        // `St3__X`: std::__X, a one-character libc++ ABI namespace.
        if let Some(at) = libcxx.find(name)
            && let Some(&ns) = name.get(at + 5)
            && ns.is_ascii_alphanumeric()
        {
            if ns == b'1' {
                self.libcxx += 1;
            } else {
                self.libcxx_alternate += 1;
            }
        } else if ndk.find(name).is_some() {
            self.libcxx += 1;
        }
        self.libstdcxx.max(self.libcxx).max(self.libcxx_alternate) < VOTES_NEEDED
    }

    /// The layout with the most evidence, if there is any.
    pub fn layout(&self) -> Option<StringLayout> {
        let best = self.libstdcxx.max(self.libcxx).max(self.libcxx_alternate);
        if best == 0 {
            None
        } else if best == self.libstdcxx {
            Some(StringLayout::Libstdcxx)
        } else if best == self.libcxx {
            Some(StringLayout::Libcxx)
        } else {
            Some(StringLayout::LibcxxAlternate)
        }
    }
}

/// Searchers for the `std::` inline namespaces in mangled names.
pub(super) struct NamespaceFinders {
    /// `St7__cxx11`: libstdc++.
    cxx11: Finder<'static>,
    /// `St3__`: a one-character libc++ namespace follows.
    libcxx: Finder<'static>,
    /// `St6__ndk1`: the Android NDK's libc++.
    ndk: Finder<'static>,
}

impl NamespaceFinders {
    pub(super) fn new() -> Self {
        NamespaceFinders {
            cxx11: Finder::new(b"St7__cxx11"),
            libcxx: Finder::new(b"St3__"),
            ndk: Finder::new(b"St6__ndk1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn votes(names: &[&str]) -> LayoutVotes {
        let finders = NamespaceFinders::new();
        let mut v = LayoutVotes::default();
        for n in names {
            v.count(n.as_bytes(), &finders);
        }
        v
    }

    #[test]
    fn tells_string_layouts_from_std_namespaces() {
        let gnu = votes(&[
            "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE9_M_createERmm",
            "_ZNSt8__detail15_List_node_base7_M_hookEPS0_",
        ]);
        assert_eq!(gnu.layout(), Some(StringLayout::Libstdcxx));
        let llvm =
            votes(&["_ZNSt3__112basic_stringIcNS_11char_traitsIcEENS_9allocatorIcEEE6appendEPKc"]);
        assert_eq!(llvm.layout(), Some(StringLayout::Libcxx));
        let tpu = votes(&[
            "_ZNSt3__u12basic_stringIcNS_11char_traitsIcEENS_9allocatorIcEEE6resizeEmc",
            "_ZNSt3__u6vectorIiNS_9allocatorIiEEE7reserveEm",
        ]);
        assert_eq!(tpu.layout(), Some(StringLayout::LibcxxAlternate));
        assert_eq!(votes(&["_ZN3foo3barEv", "main"]).layout(), None);
        assert_eq!(
            votes(&["_ZNSt6__ndk112basic_stringIcEE"]).layout(),
            Some(StringLayout::Libcxx)
        );
    }
}
