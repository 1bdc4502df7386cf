//! The record scan of the produce path (`dedup._records`), for `dedup.batches`.
//!
//! Two functions over the records of one magic-2 batch, decompressed, as they follow the
//! batch header:
//!
//! - `scan` reads every record once and says whether the batch is *uniform*: every record
//!   without identity headers (its identity, if any, is implicit), or every record with
//!   exactly one producer and one sequence header, of one producer, the sequences rising by
//!   one. It returns None for anything else: a record it cannot vouch for (a varint longer
//!   than its shortest encoding, a length that does not fit, a header key that is not
//!   UTF-8, attributes other than 0, an offset delta that is not the record's index, more
//!   headers than the bound), a chunk header, a repeated identity header, a mixed batch.
//!   The caller then reads the batch record by record (the reference rules, and their
//!   error messages, stay in Python); None is never an error in itself.
//! - `with_identity_headers` writes the records of a uniform batch of implicit identity
//!   again with the two identity headers appended to each, as `dedup.batches.build_batch`
//!   would, without decoding them into Python objects.
//!
//! Both take `data` and the offset where the records start (so a batch's own bytes need
//! no copy), and run without the GIL: a large batch does not hold the event loop's thread.
//!
//! A third, `copy_of`, copies a span of bytes without the GIL: the hand decoder of large
//! Produce requests (`proxy.kafka.produce_decoder`) copies their records with it from a
//! worker thread.

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Sequence text of an explicit identity read here: at most 18 ASCII digits, always an
/// int64 (as `dedup.batches._SHORT_SEQUENCE`); longer text goes the reference way.
const SHORT_SEQUENCE: usize = 18;
/// Timestamp deltas farther than this from 0 go the reference way (as `_SAFE_DELTA`).
const SAFE_DELTA: i64 = 1 << 62;

/// A zigzag varint at `pos` in its shortest encoding (at most 10 bytes): (value, next).
fn varint(data: &[u8], pos: usize) -> Option<(i64, usize)> {
    let mut value: u64 = 0;
    let mut shift = 0u32;
    let mut at = pos;
    loop {
        let byte = *data.get(at)?;
        at += 1;
        if shift == 63 && byte > 1 {
            return None; // bits beyond 64
        }
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            if byte == 0 && at - pos > 1 {
                return None; // not the shortest encoding
            }
            let decoded = ((value >> 1) as i64) ^ -((value & 1) as i64);
            return Some((decoded, at));
        }
        shift += 7;
        if shift > 63 {
            return None;
        }
    }
}

#[cfg(test)]
fn write_varint(out: &mut Vec<u8>, value: i64) {
    let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
    while zigzag >= 0x80 {
        out.push((zigzag as u8 & 0x7f) | 0x80);
        zigzag >>= 7;
    }
    out.push(zigzag as u8);
}

/// A length-prefixed byte string at `pos`: (Some(bytes) or None for null, next).
fn bytes_at(data: &[u8], pos: usize) -> Option<(Option<&[u8]>, usize)> {
    let (length, at) = varint(data, pos)?;
    if length == -1 {
        return Some((None, at));
    }
    if length < 0 {
        return None;
    }
    let end = at.checked_add(usize::try_from(length).ok()?)?;
    Some((Some(data.get(at..end)?), end))
}

/// One record's parts, positions into `data`.
struct Record<'a> {
    end: usize,
    timestamp_delta: i64,
    /// Where the header count starts: attributes..value end here.
    header_count_at: usize,
    header_count: i64,
    /// The header bytes after the count.
    headers_at: usize,
    producer: Option<&'a [u8]>,
    sequence: Option<&'a [u8]>,
    identity_headers: u32,
}

struct Names<'a> {
    producer: &'a [u8],
    sequence: &'a [u8],
    chunks: &'a [Vec<u8>],
    max_headers: i64,
}

fn record<'a>(data: &'a [u8], pos: usize, index: i64, names: &Names) -> Option<Record<'a>> {
    let (length, body) = varint(data, pos)?;
    if length <= 0 {
        return None;
    }
    let end = body.checked_add(usize::try_from(length).ok()?)?;
    let data = data.get(..end)?;
    if *data.get(body)? != 0 {
        return None; // record attributes: unused by Kafka, written 0 by every client
    }
    let (timestamp_delta, at) = varint(data, body + 1)?;
    if !(-SAFE_DELTA < timestamp_delta && timestamp_delta < SAFE_DELTA) {
        return None;
    }
    let (offset_delta, at) = varint(data, at)?;
    if offset_delta != index {
        return None;
    }
    let (_key, at) = bytes_at(data, at)?;
    let (_value, header_count_at) = bytes_at(data, at)?;
    let (header_count, headers_at) = varint(data, header_count_at)?;
    if header_count < 0 || header_count > names.max_headers {
        return None;
    }
    let mut found = Record {
        end,
        timestamp_delta,
        header_count_at,
        header_count,
        headers_at,
        producer: None,
        sequence: None,
        identity_headers: 0,
    };
    let mut at = headers_at;
    let mut producers = 0;
    let mut sequences = 0;
    for _ in 0..header_count {
        let (key, next) = bytes_at(data, at)?;
        let key = key?; // a null header key: the reference reader refuses it
        std::str::from_utf8(key).ok()?;
        let (value, next) = bytes_at(data, next)?;
        at = next;
        if key == names.producer {
            producers += 1;
            found.producer = value;
        } else if key == names.sequence {
            sequences += 1;
            found.sequence = value;
        } else if names.chunks.iter().any(|chunk| chunk.as_slice() == key) {
            return None; // a chunk: the chunk rules are Python's
        }
    }
    if at != end || producers > 1 || sequences > 1 || producers != sequences {
        return None;
    }
    if producers == 1 && (found.producer.is_none() || found.sequence.is_none()) {
        return None;
    }
    found.identity_headers = producers;
    Some(found)
}

fn short_sequence(text: &[u8]) -> Option<i64> {
    if text.is_empty() || text.len() > SHORT_SEQUENCE || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// `scan`'s answer: (explicit (producer, first sequence) or None, first and max timestamp
/// deltas), or None.
type ScanResult<'py> = Option<(Option<(Bound<'py, PyBytes>, i64)>, i64, i64)>;

/// What `scan` found in a uniform batch.
struct Uniform {
    explicit: Option<(Vec<u8>, i64)>,
    max_timestamp_delta: i64,
    first_timestamp_delta: i64,
}

fn scan_records(
    data: &[u8],
    count: i64,
    names: &Names,
    max_producer_bytes: usize,
) -> Option<Uniform> {
    let mut pos = 0;
    let mut index = 0;
    let mut explicit: Option<(&[u8], i64)> = None;
    let mut max_delta = i64::MIN;
    let mut first_delta = 0;
    while pos < data.len() {
        if index >= count {
            return None;
        }
        let found = record(data, pos, index, names)?;
        if index == 0 {
            first_delta = found.timestamp_delta;
        }
        max_delta = max_delta.max(found.timestamp_delta);
        match (index, found.identity_headers, explicit) {
            (_, 0, None) => {}
            (0, 1, None) => {
                let producer = found.producer?;
                if producer.is_empty() || producer.len() > max_producer_bytes {
                    return None;
                }
                std::str::from_utf8(producer).ok()?;
                explicit = Some((producer, short_sequence(found.sequence?)?));
            }
            (_, 1, Some((producer, first))) => {
                if found.producer? != producer
                    || short_sequence(found.sequence?)? != first.checked_add(index)?
                {
                    return None;
                }
            }
            _ => return None, // some records with identity headers, some without
        }
        pos = found.end;
        index += 1;
    }
    if index != count || count == 0 {
        return None;
    }
    Some(Uniform {
        explicit: explicit.map(|(producer, first)| (producer.to_vec(), first)),
        max_timestamp_delta: max_delta,
        first_timestamp_delta: first_delta,
    })
}

fn records_of(data: &[u8], start: usize) -> PyResult<&[u8]> {
    data.get(start..)
        .ok_or_else(|| PyValueError::new_err("the records start past the end of the data"))
}

/// `scan(data, start, count, producer_header, sequence_header, chunk_headers, max_headers,
/// max_producer_bytes)`: None, or (explicit, first timestamp delta, max timestamp delta)
/// where explicit is None (no record has identity headers) or (producer name bytes, first
/// sequence) of a batch whose records are that producer's, sequences first, first+1, ...
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (data, start, count, producer_header, sequence_header, chunk_headers, max_headers, max_producer_bytes))]
fn scan<'py>(
    py: Python<'py>,
    data: &[u8],
    start: usize,
    count: i64,
    producer_header: &[u8],
    sequence_header: &[u8],
    chunk_headers: Vec<Vec<u8>>,
    max_headers: i64,
    max_producer_bytes: usize,
) -> PyResult<ScanResult<'py>> {
    let records = records_of(data, start)?;
    let names = Names {
        producer: producer_header,
        sequence: sequence_header,
        chunks: &chunk_headers,
        max_headers,
    };
    let found = py.detach(|| scan_records(records, count, &names, max_producer_bytes));
    Ok(found.map(|uniform| {
        (
            uniform
                .explicit
                .map(|(producer, first)| (PyBytes::new(py, &producer), first)),
            uniform.first_timestamp_delta,
            uniform.max_timestamp_delta,
        )
    }))
}

fn varint_size(value: i64) -> usize {
    let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
    let mut size = 1;
    while zigzag >= 0x80 {
        zigzag >>= 7;
        size += 1;
    }
    size
}

fn decimal_size(mut value: i64) -> usize {
    let mut size = 1;
    while value >= 10 {
        value /= 10;
        size += 1;
    }
    size
}

/// Appends `value` (>= 0) in ASCII decimal.
fn write_decimal(out: &mut Writer, value: i64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = value;
    loop {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    out.put(&digits[at..]);
}

/// Writes into a buffer of the exact size computed beforehand.
struct Writer<'a> {
    buffer: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        self.buffer[self.at..self.at + bytes.len()].copy_from_slice(bytes);
        self.at += bytes.len();
    }

    fn put_varint(&mut self, value: i64) {
        let mut zigzag = ((value << 1) ^ (value >> 63)) as u64;
        while zigzag >= 0x80 {
            self.buffer[self.at] = (zigzag as u8 & 0x7f) | 0x80;
            self.at += 1;
            zigzag >>= 7;
        }
        self.buffer[self.at] = zigzag as u8;
        self.at += 1;
    }
}

/// How one record is written again: its parts in `data` and its new body's size.
struct Rewritten {
    body_at: usize,
    header_count_at: usize,
    header_count: i64,
    headers_at: usize,
    end: usize,
    sequence: i64,
    body_size: usize,
}

/// Every record of a uniform batch without identity headers, or None.
fn plan_rewrite(
    data: &[u8],
    count: i64,
    names: &Names,
    producer: &[u8],
    base_sequence: i64,
    modulus: i64,
) -> Option<(Vec<Rewritten>, usize)> {
    let added_fixed = varint_size(names.producer.len() as i64)
        + names.producer.len()
        + varint_size(producer.len() as i64)
        + producer.len()
        + varint_size(names.sequence.len() as i64)
        + names.sequence.len();
    let mut plan = Vec::with_capacity(usize::try_from(count).ok()?.min(1 << 20));
    let mut total = 0usize;
    let mut pos = 0;
    let mut index = 0;
    while pos < data.len() {
        let found = record(data, pos, index, names)?;
        if found.identity_headers != 0 {
            return None;
        }
        let (_, body_at) = varint(data, pos)?;
        let sequence = (base_sequence.checked_add(index)?).rem_euclid(modulus);
        let digits = decimal_size(sequence);
        let body_size = (found.header_count_at - body_at)
            + varint_size(found.header_count + 2)
            + (found.end - found.headers_at)
            + added_fixed
            + varint_size(digits as i64)
            + digits;
        total += varint_size(body_size as i64) + body_size;
        plan.push(Rewritten {
            body_at,
            header_count_at: found.header_count_at,
            header_count: found.header_count,
            headers_at: found.headers_at,
            end: found.end,
            sequence,
            body_size,
        });
        pos = found.end;
        index += 1;
    }
    (index == count).then_some((plan, total))
}

/// Writes the records again into `out`; how many bytes it wrote (all of `out`).
fn write_rewrite(
    data: &[u8],
    plan: &[Rewritten],
    names: &Names,
    producer: &[u8],
    out: &mut [u8],
) -> usize {
    let mut out = Writer { buffer: out, at: 0 };
    for part in plan {
        out.put_varint(part.body_size as i64);
        out.put(&data[part.body_at..part.header_count_at]);
        out.put_varint(part.header_count + 2);
        out.put(&data[part.headers_at..part.end]);
        out.put_varint(names.producer.len() as i64);
        out.put(names.producer);
        out.put_varint(producer.len() as i64);
        out.put(producer);
        out.put_varint(names.sequence.len() as i64);
        out.put(names.sequence);
        out.put_varint(decimal_size(part.sequence) as i64);
        write_decimal(&mut out, part.sequence);
    }
    out.at
}

/// `with_identity_headers(data, start, count, producer_header, sequence_header, producer,
/// base_sequence, modulus)`: the records again, record i with the headers producer_header:
/// producer and sequence_header: (base_sequence + i) mod modulus appended. Raises
/// ValueError for records `scan` would not call uniform without identity headers.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (data, start, count, producer_header, sequence_header, producer, base_sequence, modulus))]
fn with_identity_headers<'py>(
    py: Python<'py>,
    data: &[u8],
    start: usize,
    count: i64,
    producer_header: &[u8],
    sequence_header: &[u8],
    producer: &[u8],
    base_sequence: i64,
    modulus: i64,
) -> PyResult<Bound<'py, PyBytes>> {
    if modulus <= 0 {
        return Err(PyValueError::new_err(
            "the sequence modulus must be positive",
        ));
    }
    let records = records_of(data, start)?;
    let names = Names {
        producer: producer_header,
        sequence: sequence_header,
        chunks: &[],
        max_headers: i64::MAX - 2,
    };
    let planned =
        py.detach(|| plan_rewrite(records, count, &names, producer, base_sequence, modulus));
    let Some((plan, size)) = planned else {
        return Err(PyValueError::new_err(
            "the records are not a uniform batch without identity headers",
        ));
    };
    // Written straight into the bytes object Python gets: no copy of a large batch.
    bytes_written_without_gil(py, size, |out| {
        write_rewrite(records, &plan, &names, producer, out)
    })
}

/// A new bytes object of `len` bytes, all written by `fill` (which says how many it wrote)
/// without the GIL. PyO3's `PyBytes::new_with` zeroes the object first, with the GIL held:
/// for tens of megabytes that is most of the time (the first touch of every page), and
/// Python's other threads, the event loop's among them, stand still for it. Here the object
/// is left unwritten until `fill` runs, and never handed out unless every byte was written.
fn bytes_written_without_gil<'py, F>(
    py: Python<'py>,
    len: usize,
    fill: F,
) -> PyResult<Bound<'py, PyBytes>>
where
    F: FnOnce(&mut [u8]) -> usize + Send,
{
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| PyValueError::new_err(format!("{len} bytes are too many")))?;
    // SAFETY: a bytes object made from a null pointer is new, uniquely ours and writable
    // until it is handed out; its `len` bytes stay valid while `bytes` holds it.
    unsafe {
        let object = ffi::PyBytes_FromStringAndSize(std::ptr::null(), size);
        let bytes = Bound::from_owned_ptr_or_err(py, object)?.cast_into_unchecked::<PyBytes>();
        let buffer =
            std::slice::from_raw_parts_mut(ffi::PyBytes_AsString(object).cast::<u8>(), len);
        let written = py.detach(|| fill(buffer));
        if written != len {
            return Err(PyValueError::new_err(format!(
                "{written} of {len} bytes written: the object is not handed out"
            )));
        }
        Ok(bytes)
    }
}

/// `copy_of(data, start, end)`: a new bytes object of data[start:end], copied with the GIL
/// released. Python's slicing holds the GIL while it copies: from a worker thread, a copy
/// of tens of megabytes would still hold the event loop for as long.
#[pyfunction]
fn copy_of<'py>(
    py: Python<'py>,
    data: &[u8],
    start: usize,
    end: usize,
) -> PyResult<Bound<'py, PyBytes>> {
    let Some(span) = data.get(start..end) else {
        return Err(PyValueError::new_err(format!(
            "bytes {start}..{end} are not within {} bytes",
            data.len()
        )));
    };
    bytes_written_without_gil(py, span.len(), |out| {
        out.copy_from_slice(span);
        out.len()
    })
}

#[pymodule]
fn _records(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_function(wrap_pyfunction!(scan, module)?)?;
    module.add_function(wrap_pyfunction!(with_identity_headers, module)?)?;
    module.add_function(wrap_pyfunction!(copy_of, module)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_in_their_shortest_encoding() {
        for value in [
            0,
            1,
            -1,
            63,
            -64,
            64,
            1 << 31,
            -(1 << 40),
            i64::MAX,
            i64::MIN,
        ] {
            let mut out = Vec::new();
            write_varint(&mut out, value);
            assert_eq!(varint(&out, 0), Some((value, out.len())));
        }
    }

    #[test]
    fn a_longer_encoding_than_the_shortest_is_refused() {
        assert_eq!(varint(&[0x80, 0x00], 0), None);
        assert_eq!(varint(&[0x82, 0x00], 0), None);
        assert_eq!(varint(&[0x02], 0), Some((1, 1)));
    }
}
