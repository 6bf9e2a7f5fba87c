//! Whether the agent may register RecordFunction callbacks in a PyTorch
//! process: the struct it passes (`at::RecordFunctionCallback`, by value)
//! and the scopes it names must be laid out as it lays them out. That is
//! checked against the headers installed with the very `libtorch_cpu.so`
//! the process mapped (`torch/include/ATen/record_function.h`), never
//! assumed from a version number: a PyTorch whose header differs, or that
//! has none, gets no ops and a line saying why. The members around a
//! RecordFunction's sequence number are checked the same way: the agent
//! reads it only where they are declared as it expects.

use std::path::Path;

use crate::procfs;

/// Why a process gets no ops that is no news (it runs no PyTorch).
pub const NO_PYTORCH: &str = "no PyTorch loaded";

/// Longest header read.
const MAX_HEADER_BYTES: u64 = 1 << 20;
/// The most of `torch/version.py` read.
const MAX_VERSION_BYTES: u64 = 64 << 10;

/// The PyTorch a process runs, once its callback layout is checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TorchAbi {
    /// `torch.__version__`, where `version.py` says it.
    pub version: Option<String>,
    /// Whether its header declares `at::RecordFunction`'s members around
    /// the sequence number as the agent reads them ([`SEQUENCE_EXPECTED`]).
    pub sequence_numbers: bool,
}

/// The declarations the agent's layout depends on, each as a run of
/// tokens that must appear in the header, in this order. The callback
/// struct's members (start and end pointers, the sampling probability,
/// one flag per scope, three needs-flags: 40 bytes), the callback types'
/// signatures the trampoline follows, and the functions it calls.
const EXPECTED: &[&str] = &[
    "enum class C10_API_ENUM RecordScope : uint8_t { \
     FUNCTION = 0, BACKWARD_FUNCTION, TORCHSCRIPT_FUNCTION, KERNEL_FUNCTION_DTYPE, \
     CUSTOM_CLASS, BUILD_FEATURE, LITE_INTERPRETER, USER_SCOPE, STATIC_RUNTIME_OP, \
     STATIC_RUNTIME_MODEL, NUM_SCOPES, };",
    "class TORCH_API RecordFunctionCallback { public: using StartCallback = \
     std::unique_ptr<ObserverContext> (*)(const RecordFunction&); using EndCallback = \
     void (*)(const RecordFunction&, ObserverContext*);",
    "private: StartCallback start_; EndCallback end_; double sampling_prob_ = 1.0; \
     std::array<bool, static_cast<size_t>(RecordScope::NUM_SCOPES)> scopes_ = {}; \
     bool needs_inputs_ = false; bool needs_outputs_ = false; bool needs_ids_ = false; };",
    "const char* name() const;",
    "TORCH_API CallbackHandle addGlobalCallback(RecordFunctionCallback cb);",
    "TORCH_API void removeCallback(CallbackHandle handle);",
    "typedef uint64_t CallbackHandle;",
];

/// The declarations the agent's reading of a RecordFunction's sequence
/// number depends on (`tracer_agent`'s `torch_ops::layout`): the accessors
/// whose code it reads, and the members from the name to `is_async_`, in
/// this order and of these types.
const SEQUENCE_EXPECTED: &[&str] = &[
    "int64_t seqNr() const { return sequence_nr_; }",
    "size_t num_inputs() const;",
    "bool isAsync() const;",
    "std::variant<std::string, schema_ref_t> fn_; int64_t sequence_nr_ = -1; \
     c10::ArrayRef<const IValue> inputs_; std::unordered_map<std::string, IValue> kwinputs_; \
     std::vector<c10::IValue> outputs_; uint64_t fwd_thread_id_ = 0; \
     RecordFunctionHandle handle_{0}; bool is_async_{false};",
];

/// Whether `pid`, with `maps` its mappings, runs a PyTorch whose
/// callbacks the agent can register; the error is why not, one line.
pub fn check(pid: u32, maps: &str) -> Result<TorchAbi, String> {
    let library = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .ok_or(NO_PYTORCH)?;
    let torch = Path::new(library)
        .parent()
        .and_then(Path::parent)
        .ok_or("libtorch_cpu.so is not in a torch/lib directory")?;
    // Read in the process's root as it sees its files: links stay inside
    // it, and only regular files of a bounded size are read.
    let root = procfs::TargetRoot::open(pid).map_err(|e| format!("its root is unreadable: {e}"))?;
    let read = |relative: &str, max: u64| -> std::io::Result<String> {
        let bytes = root.read_regular(&torch.join(relative), max)?;
        String::from_utf8(bytes).map_err(std::io::Error::other)
    };
    let version = read("version.py", MAX_VERSION_BYTES)
        .ok()
        .and_then(|v| parse_version(&v));
    let header_path = torch.join("include/ATen/record_function.h");
    let named = match &version {
        Some(v) => format!("PyTorch {v}"),
        None => "this PyTorch".to_string(),
    };
    let header = read("include/ATen/record_function.h", MAX_HEADER_BYTES).map_err(|e| {
        format!(
            "{named}: cannot check its RecordFunction callback layout, {} unreadable ({e})",
            header_path.display()
        )
    })?;
    check_header(&header, EXPECTED).map_err(|missing| {
        format!(
            "{named}: its RecordFunction callbacks are not laid out as ebtrace's agent \
             lays them out ({} does not declare `{missing}`)",
            header_path.display()
        )
    })?;
    Ok(TorchAbi {
        version,
        sequence_numbers: check_header(&header, SEQUENCE_EXPECTED).is_ok(),
    })
}

/// `__version__ = '2.15.0+cu132'` → `2.15.0+cu132`.
fn parse_version(text: &str) -> Option<String> {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("__version__"))?;
    let value = line.split_once('=')?.1.trim();
    let value = value.trim_matches(|c| c == '\'' || c == '"');
    (!value.is_empty() && value.len() <= 64 && value.chars().all(|c| c.is_ascii_graphic()))
        .then(|| value.to_string())
}

/// The header's tokens, comments dropped and whitespace made one space
/// (and none inside `<...>` and around punctuation that C++ does not need
/// it for).
fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |i| &after[i..]);
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |i| &after[i + 2..]);
        } else {
            let c = rest.chars().next().expect("not empty");
            rest = &rest[c.len_utf8()..];
            if c.is_whitespace() {
                if !out.ends_with(' ') {
                    out.push(' ');
                }
            } else {
                out.push(c);
            }
        }
    }
    out
}

/// Checks `header` for every declaration of `expected`; the error is the
/// first one missing.
fn check_header(header: &str, expected: &[&'static str]) -> Result<(), &'static str> {
    let header = normalize(header);
    for expected in expected {
        if !header.contains(&normalize(expected)) {
            return Err(expected);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The declarations as PyTorch 2.15's header has them, with its
    /// comments and line breaks.
    const HEADER: &str = include_str!("../../../tests/fixtures/record_function_2_15.h");

    #[test]
    fn pytorch_2_15s_header_has_the_layout() {
        assert_eq!(check_header(HEADER, EXPECTED), Ok(()));
        assert_eq!(check_header(HEADER, SEQUENCE_EXPECTED), Ok(()));
    }

    #[test]
    fn a_member_added_near_the_sequence_number_leaves_it_out() {
        let added = HEADER.replace(
            "  int64_t sequence_nr_ = -1;\n",
            "  int64_t sequence_nr_ = -1;\n  int64_t generation_ = 0;\n",
        );
        assert_ne!(added, HEADER);
        assert!(
            check_header(&added, SEQUENCE_EXPECTED)
                .unwrap_err()
                .contains("sequence_nr_")
        );
        assert_eq!(check_header(&added, EXPECTED), Ok(()));
    }

    #[test]
    fn a_member_added_or_moved_fails_the_check() {
        let moved = HEADER.replace(
            "  double sampling_prob_ = 1.0;\n",
            "  int priority_ = 0;\n  double sampling_prob_ = 1.0;\n",
        );
        assert_ne!(moved, HEADER);
        assert!(
            check_header(&moved, EXPECTED)
                .unwrap_err()
                .contains("sampling_prob_")
        );
        let scope = HEADER.replace("  USER_SCOPE,\n", "  USER_SCOPE,\n  NEW_SCOPE,\n");
        assert_ne!(scope, HEADER);
        assert!(
            check_header(&scope, EXPECTED)
                .unwrap_err()
                .contains("RecordScope")
        );
        assert!(check_header("", EXPECTED).is_err());
    }

    #[test]
    fn versions_come_from_version_py() {
        assert_eq!(
            parse_version("from typing import Optional\n__version__ = '2.15.0+cu132'\n"),
            Some("2.15.0+cu132".into())
        );
        assert_eq!(parse_version("__version__ = ''"), None);
        assert_eq!(parse_version("x = 1"), None);
    }
}
