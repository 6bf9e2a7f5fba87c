//! Where an `at::RecordFunction` keeps its sequence number, read from the
//! machine code of the very `libtorch_cpu.so` the process runs.
//!
//! `seqNr()` is inline, so no symbol gives it; but three of its neighbours'
//! accessors are exported, and each reads a member at a fixed distance
//! from it. ebtrace checked that the header installed with this PyTorch
//! declares the members in the order these distances follow from
//! (`tracer-user`'s `agent::torch_abi`); here the code must say the same
//! offset three ways, or there are no sequence numbers:
//!
//! - `name()` tests the index of `fn_` (a `std::variant<std::string,
//!   schema_ref_t>`, whose index byte follows its 32-byte string);
//!   `sequence_nr_` is the next 8-aligned member.
//! - `num_inputs()` tests that index too, then loads `inputs_.size()`;
//!   `inputs_` (an `ArrayRef`: a pointer and a size) follows `sequence_nr_`.
//! - `isAsync()` loads `is_async_`, 120 bytes after `sequence_nr_`: past
//!   it `inputs_` (16), `kwinputs_` (an `unordered_map`, 56), `outputs_` (a
//!   `vector`, 24), `fwd_thread_id_` (8) and `handle_` (8).

/// `const char* at::RecordFunction::name() const`.
pub const NAME: &core::ffi::CStr = c"_ZNK2at14RecordFunction4nameEv";
/// `size_t at::RecordFunction::num_inputs() const`.
pub const NUM_INPUTS: &core::ffi::CStr = c"_ZNK2at14RecordFunction10num_inputsEv";
/// `bool at::RecordFunction::isAsync() const`.
pub const IS_ASYNC: &core::ffi::CStr = c"_ZNK2at14RecordFunction7isAsyncEv";

/// Bytes from `sequence_nr_` to `is_async_`.
const SEQUENCE_TO_IS_ASYNC: u32 = 120;
/// Bytes from `sequence_nr_` to `inputs_.size()`.
const SEQUENCE_TO_INPUTS_SIZE: u32 = 16;
/// Farthest a member may lie: a RecordFunction is a few hundred bytes.
const MAX_OFFSET: u32 = 4096;

/// The offset of `sequence_nr_`, from the code of `name()`,
/// `num_inputs()` and `isAsync()`; the error says which disagrees.
pub fn sequence_offset(
    name: &[u8],
    num_inputs: &[u8],
    is_async: &[u8],
) -> Result<u32, &'static str> {
    let (index, _) = variant_index_test(name).ok_or("name() does not test fn_'s index first")?;
    let from_name = (index + 1).next_multiple_of(8);
    let (index_again, size) =
        inputs_size_load(num_inputs).ok_or("num_inputs() does not read inputs_'s size")?;
    let from_inputs = size
        .checked_sub(SEQUENCE_TO_INPUTS_SIZE)
        .ok_or("inputs_ lies too low")?;
    let async_at = byte_load(is_async).ok_or("isAsync() does not load one byte")?;
    let from_async = async_at
        .checked_sub(SEQUENCE_TO_IS_ASYNC)
        .ok_or("is_async_ lies too low")?;
    if index_again != index || from_inputs != from_name || from_async != from_name {
        return Err("name(), num_inputs() and isAsync() place the sequence number apart");
    }
    if from_name > MAX_OFFSET {
        return Err("the sequence number lies too far in");
    }
    Ok(from_name)
}

/// A displacement from `%rdi` in `modrm`'s encoding (mod 01: 8 bits, mod
/// 10: 32 bits, base `%rdi`, no index), with what follows it.
fn displacement(modrm_reg: u8, code: &[u8]) -> Option<(u32, &[u8])> {
    let (&modrm, rest) = code.split_first()?;
    match modrm {
        m if m == 0x47 | (modrm_reg << 3) => {
            let (&d, rest) = rest.split_first()?;
            (d < 0x80).then_some((u32::from(d), rest))
        }
        m if m == 0x87 | (modrm_reg << 3) => {
            let d = rest.get(..4)?;
            let d = i32::from_le_bytes(d.try_into().ok()?);
            Some((u32::try_from(d).ok()?, &rest[4..]))
        }
        _ => None,
    }
}

/// `cmpb $0, disp(%rdi)` at the start of `code`: the displacement, and
/// the code after it.
fn variant_index_test(code: &[u8]) -> Option<(u32, &[u8])> {
    let rest = code.strip_prefix(&[0x80])?;
    // `/7` is cmp.
    let (d, rest) = displacement(7, rest)?;
    let rest = rest.strip_prefix(&[0x00])?;
    Some((d, rest))
}

/// `cmpb $0, idx(%rdi); jne …; mov disp(%rdi), %rax; ret`: the index's
/// and the load's displacements.
fn inputs_size_load(code: &[u8]) -> Option<(u32, u32)> {
    let (index, rest) = variant_index_test(code)?;
    let rest = rest.strip_prefix(&[0x75])?.get(1..)?;
    let rest = rest.strip_prefix(&[0x48, 0x8b])?;
    // `%rax` is register 0.
    let (size, rest) = displacement(0, rest)?;
    rest.starts_with(&[0xc3]).then_some((index, size))
}

/// `movzbl disp(%rdi), %eax; ret`: the displacement.
fn byte_load(code: &[u8]) -> Option<u32> {
    let rest = code.strip_prefix(&[0x0f, 0xb6])?;
    let (d, rest) = displacement(0, rest)?;
    rest.starts_with(&[0xc3]).then_some(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The three accessors as PyTorch 2.15.0's x86-64 `libtorch_cpu.so` has
    // them (objdump): `fn_` at 0xa0, its index at 0xc0, `sequence_nr_` at
    // 0xc8, `inputs_` at 0xd0, `is_async_` at 0x140.
    const NAME_2_15: &[u8] = &[
        0x80, 0xbf, 0xc0, 0, 0, 0, 0, 0x48, 0x8b, 0x87, 0xa0, 0, 0, 0, 0x75, 0x08, 0xc3,
    ];
    const NUM_INPUTS_2_15: &[u8] = &[
        0x80, 0xbf, 0xc0, 0, 0, 0, 0, 0x75, 0x0f, 0x48, 0x8b, 0x87, 0xd8, 0, 0, 0, 0xc3,
    ];
    const IS_ASYNC_2_15: &[u8] = &[0x0f, 0xb6, 0x87, 0x40, 0x01, 0, 0, 0xc3];

    #[test]
    fn pytorch_2_15s_code_places_the_sequence_number() {
        assert_eq!(
            sequence_offset(NAME_2_15, NUM_INPUTS_2_15, IS_ASYNC_2_15),
            Ok(0xc8)
        );
    }

    #[test]
    fn code_that_disagrees_or_differs_gives_none() {
        // A member added between the sequence number and is_async_.
        let moved = [0x0f, 0xb6, 0x87, 0x48, 0x01, 0, 0, 0xc3];
        assert!(sequence_offset(NAME_2_15, NUM_INPUTS_2_15, &moved).is_err());
        // A load of another width.
        let wide = [0x8b, 0x87, 0x40, 0x01, 0, 0, 0xc3];
        assert!(sequence_offset(NAME_2_15, NUM_INPUTS_2_15, &wide).is_err());
        // Cut short, or empty.
        assert!(sequence_offset(&NAME_2_15[..4], NUM_INPUTS_2_15, IS_ASYNC_2_15).is_err());
        assert!(sequence_offset(NAME_2_15, &NUM_INPUTS_2_15[..12], IS_ASYNC_2_15).is_err());
        assert!(sequence_offset(&[], &[], &[]).is_err());
        // A negative displacement.
        let negative = [0x0f, 0xb6, 0x87, 0x40, 0x01, 0, 0x80, 0xc3];
        assert!(sequence_offset(NAME_2_15, NUM_INPUTS_2_15, &negative).is_err());
    }

    #[test]
    fn short_displacements_are_read_too() {
        let name = [0x80, 0x7f, 0x20, 0x00];
        let num_inputs = [
            0x80, 0x7f, 0x20, 0x00, 0x75, 0x05, 0x48, 0x8b, 0x47, 0x38, 0xc3,
        ];
        let is_async = [0x0f, 0xb6, 0x87, 0xa0, 0, 0, 0, 0xc3];
        assert_eq!(sequence_offset(&name, &num_inputs, &is_async), Ok(0x28));
    }
}
