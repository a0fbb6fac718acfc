//! The state-file record: type, encoder and strict parser (format in the module docs).

use std::fmt;

use crate::time::UnixMs;

/// The largest record [`EpochRecord::parse`] accepts, in bytes (newline included).
///
/// The longest valid version-1 record is 162 bytes; the limit leaves room and bounds
/// the work and the error messages of a parse of an arbitrary file.
pub const MAX_RECORD_BYTES: usize = 256;

/// The first token of every record.
pub const MAGIC: &str = "flock-epoch";

/// The record format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;

/// The longest [`WriterId`], in bytes.
pub const MAX_WRITER_LEN: usize = 64;

/// The field names, in the order they are written.
const FIELDS: [&str; 4] = ["epoch", "base_id", "heartbeat_unix_ms", "writer"];

/// The supervisor instance that wrote a record, e.g. its pod name.
///
/// 1 to [`MAX_WRITER_LEN`] characters from `A-Z a-z 0-9 . _ -`, starting with a letter
/// or a digit, so it is one token in the record and safe to print in a log.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WriterId(String);

/// A string that is not a valid [`WriterId`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "writer is not a valid id: {value:?} (1 to 64 characters from A-Z a-z 0-9 . _ -, \
     starting with a letter or digit)"
)]
pub struct InvalidWriterId {
    /// The rejected string.
    pub value: String,
}

impl WriterId {
    /// Validates `id`.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidWriterId> {
        let id = id.into();
        let bytes = id.as_bytes();
        let valid = !bytes.is_empty()
            && bytes.len() <= MAX_WRITER_LEN
            && bytes[0].is_ascii_alphanumeric()
            && bytes
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if valid {
            Ok(Self(id))
        } else {
            Err(InvalidWriterId { value: id })
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WriterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<&str> for WriterId {
    type Error = InvalidWriterId;

    fn try_from(id: &str) -> Result<Self, Self::Error> {
        Self::new(id)
    }
}

/// What the state file says: which epoch of which base id is LIVE, as of when, and
/// according to whom.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct EpochRecord {
    /// The Envoy restart epoch (`--restart-epoch`).
    pub epoch: u32,
    /// The Envoy base id (`--base-id`) the epoch runs under.
    pub base_id: u32,
    /// When the writer last confirmed the epoch LIVE, in unix-epoch milliseconds.
    pub heartbeat_unix_ms: UnixMs,
    /// The supervisor instance that wrote the record.
    pub writer: WriterId,
}

/// How far a heartbeat is from now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeartbeatAge {
    /// The heartbeat is this many milliseconds in the past (or exactly now).
    Ago(u64),
    /// The heartbeat is this many milliseconds in the future (the clock was stepped
    /// back, or the writer's clock is ahead).
    Ahead(u64),
}

impl HeartbeatAge {
    /// The distance from now in milliseconds, in either direction.
    pub fn distance_ms(self) -> u64 {
        match self {
            Self::Ago(ms) | Self::Ahead(ms) => ms,
        }
    }
}

impl fmt::Display for HeartbeatAge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ago(ms) => write!(f, "{ms} ms old"),
            Self::Ahead(ms) => write!(f, "{ms} ms in the future"),
        }
    }
}

/// A heartbeat's age judged against the maximum age: whether a record is fresh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Freshness {
    /// The heartbeat's distance from now.
    pub age: HeartbeatAge,
    /// The largest distance that still counts as fresh, in milliseconds.
    pub max_age_ms: u64,
}

impl Freshness {
    /// Whether the heartbeat is at most `max_age_ms` from now, in either direction.
    pub fn is_fresh(self) -> bool {
        self.age.distance_ms() <= self.max_age_ms
    }
}

impl fmt::Display for Freshness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let verdict = if self.is_fresh() { "fresh" } else { "stale" };
        write!(
            f,
            "heartbeat {} ({verdict}; limit {} ms)",
            self.age, self.max_age_ms
        )
    }
}

impl EpochRecord {
    /// A record.
    pub fn new(epoch: u32, base_id: u32, heartbeat_unix_ms: UnixMs, writer: WriterId) -> Self {
        Self {
            epoch,
            base_id,
            heartbeat_unix_ms,
            writer,
        }
    }

    /// The record's one line of text, newline included (at most 162 bytes).
    pub fn encode(&self) -> String {
        format!(
            "{MAGIC} v{FORMAT_VERSION} epoch={} base_id={} heartbeat_unix_ms={} writer={}\n",
            self.epoch,
            self.base_id,
            self.heartbeat_unix_ms.as_millis(),
            self.writer
        )
    }

    /// Parses a whole state file. Strict: anything but exactly one canonical record is
    /// an error that says what is wrong; it never panics.
    pub fn parse(bytes: &[u8]) -> Result<Self, EpochRecordError> {
        parse(bytes)
    }

    /// How far the heartbeat is from `now_unix_ms`.
    pub fn heartbeat_age(&self, now_unix_ms: UnixMs) -> HeartbeatAge {
        if self.heartbeat_unix_ms <= now_unix_ms {
            HeartbeatAge::Ago(now_unix_ms.since(self.heartbeat_unix_ms))
        } else {
            HeartbeatAge::Ahead(self.heartbeat_unix_ms.since(now_unix_ms))
        }
    }

    /// The heartbeat's age judged against `heartbeat_max_age_ms`.
    pub fn freshness(&self, now_unix_ms: UnixMs, heartbeat_max_age_ms: u64) -> Freshness {
        Freshness {
            age: self.heartbeat_age(now_unix_ms),
            max_age_ms: heartbeat_max_age_ms,
        }
    }

    /// Whether the heartbeat is at most `heartbeat_max_age_ms` from `now_unix_ms`.
    pub fn is_fresh(&self, now_unix_ms: UnixMs, heartbeat_max_age_ms: u64) -> bool {
        self.freshness(now_unix_ms, heartbeat_max_age_ms).is_fresh()
    }

    /// The first instant at which the record is stale (saturating).
    pub(crate) fn stale_at(&self, heartbeat_max_age_ms: u64) -> UnixMs {
        self.heartbeat_unix_ms.plus(heartbeat_max_age_ms).plus(1)
    }
}

impl fmt::Display for EpochRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "epoch {} (base id {}, writer {}, heartbeat at {} ms)",
            self.epoch,
            self.base_id,
            self.writer,
            self.heartbeat_unix_ms.as_millis()
        )
    }
}

/// Why [`EpochRecord::parse`] rejected a state file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EpochRecordError {
    /// The file is empty (or only a newline).
    #[error("record is empty")]
    Empty,
    /// The file is larger than [`MAX_RECORD_BYTES`].
    #[error("record is {len} bytes; the limit is {limit}")]
    TooLarge {
        /// The file's size.
        len: usize,
        /// [`MAX_RECORD_BYTES`].
        limit: usize,
    },
    /// A byte that is not printable ASCII before the newline.
    #[error(
        "invalid byte 0x{byte:02x} at offset {offset}: a record is one line of printable ASCII"
    )]
    InvalidByte {
        /// The byte's offset in the file.
        offset: usize,
        /// The byte.
        byte: u8,
    },
    /// The record does not end with a newline: probably a torn write.
    #[error("record is not terminated by a newline (truncated write?)")]
    Unterminated,
    /// Bytes after the record's newline.
    #[error("trailing data after the record ({len} bytes after the newline)")]
    TrailingData {
        /// How many bytes follow the newline.
        len: usize,
    },
    /// A leading, trailing or doubled space.
    #[error("unexpected space at offset {offset}: tokens are separated by exactly one space")]
    StraySpace {
        /// The offset of the stray space.
        offset: usize,
    },
    /// The first token is not [`MAGIC`].
    #[error("not a flock epoch record: expected \"flock-epoch\", found {found:?}")]
    BadMagic {
        /// The first token.
        found: String,
    },
    /// Nothing after the magic.
    #[error("missing version after \"flock-epoch\"")]
    MissingVersion,
    /// The second token is not `v` followed by a plain decimal number.
    #[error("malformed version {found:?}: expected v<number>")]
    MalformedVersion {
        /// The second token.
        found: String,
    },
    /// A well-formed version this build does not read.
    #[error("unknown version {found} (this build reads v1)")]
    UnknownVersion {
        /// The second token, e.g. `v2`.
        found: String,
    },
    /// A token without `=`.
    #[error("malformed field {token:?}: expected key=value")]
    MalformedField {
        /// The token.
        token: String,
    },
    /// A key this version does not define.
    #[error("unknown field {key:?}")]
    UnknownField {
        /// The key.
        key: String,
    },
    /// A key that appears more than once.
    #[error("duplicated field {key}")]
    DuplicateField {
        /// The key.
        key: &'static str,
    },
    /// A required key that does not appear.
    #[error("missing field {key}")]
    MissingField {
        /// The key.
        key: &'static str,
    },
    /// All keys present once, but not in the canonical order.
    #[error(
        "field {found} is out of order: expected {expected} \
         (the order is epoch, base_id, heartbeat_unix_ms, writer)"
    )]
    OutOfOrder {
        /// The key at this position.
        found: &'static str,
        /// The key the canonical order puts here.
        expected: &'static str,
    },
    /// A numeric field with a character other than a digit (signs included), or empty.
    #[error("{field} is not a number: {value:?}")]
    NotANumber {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
    },
    /// A numeric field written with a leading zero.
    #[error("{field} has a leading zero: {value:?}")]
    LeadingZero {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
    },
    /// A numeric field larger than its type.
    #[error("{field} is out of range: {value:?} (the maximum is {max})")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// The field type's maximum.
        max: u64,
    },
    /// The `writer` field is not a valid [`WriterId`].
    #[error(transparent)]
    InvalidWriter(#[from] InvalidWriterId),
}

fn parse(bytes: &[u8]) -> Result<EpochRecord, EpochRecordError> {
    if bytes.len() > MAX_RECORD_BYTES {
        return Err(EpochRecordError::TooLarge {
            len: bytes.len(),
            limit: MAX_RECORD_BYTES,
        });
    }
    let newline = bytes.iter().position(|&b| b == b'\n');
    let line = &bytes[..newline.unwrap_or(bytes.len())];
    if let Some(offset) = line.iter().position(|b| !(b' '..=b'~').contains(b)) {
        return Err(EpochRecordError::InvalidByte {
            offset,
            byte: line[offset],
        });
    }
    let Some(newline) = newline else {
        return Err(if bytes.is_empty() {
            EpochRecordError::Empty
        } else {
            EpochRecordError::Unterminated
        });
    };
    let trailing = bytes.len() - newline - 1;
    if trailing > 0 {
        return Err(EpochRecordError::TrailingData { len: trailing });
    }
    if line.is_empty() {
        return Err(EpochRecordError::Empty);
    }
    // Printable ASCII, checked above.
    let line = std::str::from_utf8(line).map_err(|_| EpochRecordError::Unterminated)?;

    let mut tokens = Vec::with_capacity(6);
    let mut offset = 0;
    for token in line.split(' ') {
        if token.is_empty() {
            // An empty token sits where a stray space is (or just after one at the end).
            return Err(EpochRecordError::StraySpace {
                offset: offset.min(line.len() - 1),
            });
        }
        tokens.push(token);
        offset += token.len() + 1;
    }
    let mut tokens = tokens.into_iter();
    match tokens.next() {
        Some(MAGIC) => {}
        found => {
            return Err(EpochRecordError::BadMagic {
                found: found.unwrap_or_default().to_owned(),
            });
        }
    }
    let version = tokens.next().ok_or(EpochRecordError::MissingVersion)?;
    check_version(version)?;

    // Key/value pairs, checked in the order that gives the most useful message:
    // malformed, unknown, duplicated, missing, out of order, then the values.
    let mut fields: Vec<(usize, &str)> = Vec::with_capacity(FIELDS.len());
    let mut seen = [false; FIELDS.len()];
    for token in tokens {
        let Some((key, value)) = token.split_once('=') else {
            return Err(EpochRecordError::MalformedField {
                token: token.to_owned(),
            });
        };
        let Some(index) = FIELDS.iter().position(|f| *f == key) else {
            return Err(EpochRecordError::UnknownField {
                key: key.to_owned(),
            });
        };
        if seen[index] {
            return Err(EpochRecordError::DuplicateField { key: FIELDS[index] });
        }
        seen[index] = true;
        fields.push((index, value));
    }
    if let Some(missing) = seen.iter().position(|s| !s) {
        return Err(EpochRecordError::MissingField {
            key: FIELDS[missing],
        });
    }
    let mut values = [""; FIELDS.len()];
    for (position, &(index, value)) in fields.iter().enumerate() {
        if index != position {
            return Err(EpochRecordError::OutOfOrder {
                found: FIELDS[index],
                expected: FIELDS[position],
            });
        }
        values[index] = value;
    }
    let [epoch, base_id, heartbeat, writer] = values;
    Ok(EpochRecord {
        epoch: parse_u32(FIELDS[0], epoch)?,
        base_id: parse_u32(FIELDS[1], base_id)?,
        heartbeat_unix_ms: UnixMs(parse_decimal(FIELDS[2], heartbeat, u64::MAX)?),
        writer: WriterId::new(writer)?,
    })
}

fn check_version(token: &str) -> Result<(), EpochRecordError> {
    let malformed = || EpochRecordError::MalformedVersion {
        found: token.to_owned(),
    };
    let digits = token.strip_prefix('v').ok_or_else(malformed)?;
    let well_formed = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    if !well_formed {
        return Err(malformed());
    }
    if digits == FORMAT_VERSION.to_string() {
        Ok(())
    } else {
        Err(EpochRecordError::UnknownVersion {
            found: token.to_owned(),
        })
    }
}

fn parse_u32(field: &'static str, value: &str) -> Result<u32, EpochRecordError> {
    let n = parse_decimal(field, value, u64::from(u32::MAX))?;
    // parse_decimal bounded it by u32::MAX.
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// A plain decimal: digits only, no leading zero, at most `max`.
fn parse_decimal(field: &'static str, value: &str, max: u64) -> Result<u64, EpochRecordError> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(EpochRecordError::NotANumber {
            field,
            value: value.to_owned(),
        });
    }
    if value.len() > 1 && value.starts_with('0') {
        return Err(EpochRecordError::LeadingZero {
            field,
            value: value.to_owned(),
        });
    }
    let out_of_range = || EpochRecordError::OutOfRange {
        field,
        value: value.to_owned(),
        max,
    };
    let mut n: u64 = 0;
    for b in value.bytes() {
        n = n
            .checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(b - b'0')))
            .ok_or_else(out_of_range)?;
    }
    if n > max {
        return Err(out_of_range());
    }
    Ok(n)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const GOOD: &str =
        "flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1764400000123 writer=node-a\n";

    fn record() -> EpochRecord {
        EpochRecord::new(
            3,
            7,
            UnixMs(1_764_400_000_123),
            WriterId::new("node-a").unwrap(),
        )
    }

    fn err(text: &str) -> String {
        EpochRecord::parse(text.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn encodes_the_documented_line() {
        assert_eq!(record().encode(), GOOD);
    }

    #[test]
    fn parses_the_documented_line() {
        assert_eq!(EpochRecord::parse(GOOD.as_bytes()), Ok(record()));
    }

    #[test]
    fn longest_record_fits_the_limit() {
        let longest = EpochRecord::new(
            u32::MAX,
            u32::MAX,
            UnixMs(u64::MAX),
            WriterId::new("w".repeat(MAX_WRITER_LEN)).unwrap(),
        );
        let text = longest.encode();
        assert_eq!(text.len(), 162);
        assert!(text.len() <= MAX_RECORD_BYTES);
        assert_eq!(EpochRecord::parse(text.as_bytes()), Ok(longest));
    }

    #[test]
    fn zero_values_round_trip() {
        let zero = EpochRecord::new(0, 0, UnixMs::ZERO, WriterId::new("0").unwrap());
        assert_eq!(
            zero.encode(),
            "flock-epoch v1 epoch=0 base_id=0 heartbeat_unix_ms=0 writer=0\n"
        );
        assert_eq!(EpochRecord::parse(zero.encode().as_bytes()), Ok(zero));
    }

    #[test]
    fn rejects_oversized_file_before_reading_it() {
        let big = "x".repeat(300);
        assert_eq!(err(&big), "record is 300 bytes; the limit is 256");
    }

    #[test]
    fn rejects_empty_file_and_lone_newline() {
        assert_eq!(err(""), "record is empty");
        assert_eq!(err("\n"), "record is empty");
    }

    #[test]
    fn rejects_unknown_version() {
        assert_eq!(
            err("flock-epoch v2 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=a\n"),
            "unknown version v2 (this build reads v1)"
        );
        assert!(err("flock-epoch v0 epoch=3\n").starts_with("unknown version v0"));
    }

    #[test]
    fn rejects_malformed_version() {
        for v in ["1", "v", "v01", "vx", "V1", "v+1"] {
            let text = format!("flock-epoch {v} epoch=3 base_id=7 heartbeat_unix_ms=1 writer=a\n");
            assert_eq!(
                err(&text),
                format!("malformed version {v:?}: expected v<number>")
            );
        }
        assert_eq!(
            err("flock-epoch\n"),
            "missing version after \"flock-epoch\""
        );
    }

    #[test]
    fn rejects_wrong_magic() {
        assert_eq!(
            err("flock-epochs v1\n"),
            "not a flock epoch record: expected \"flock-epoch\", found \"flock-epochs\""
        );
        assert!(err("{\"epoch\": 3}\n").starts_with("not a flock epoch record"));
    }

    #[test]
    fn rejects_missing_field() {
        assert_eq!(
            err("flock-epoch v1 epoch=3 heartbeat_unix_ms=1 writer=a\n"),
            "missing field base_id"
        );
        assert_eq!(err("flock-epoch v1\n"), "missing field epoch");
    }

    #[test]
    fn rejects_duplicated_field() {
        assert_eq!(
            err("flock-epoch v1 epoch=3 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=a\n"),
            "duplicated field epoch"
        );
    }

    #[test]
    fn rejects_unknown_and_malformed_fields() {
        assert_eq!(
            err("flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=a pid=9\n"),
            "unknown field \"pid\""
        );
        assert_eq!(
            err("flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1 writer\n"),
            "malformed field \"writer\": expected key=value"
        );
    }

    #[test]
    fn rejects_fields_out_of_order() {
        assert_eq!(
            err("flock-epoch v1 base_id=7 epoch=3 heartbeat_unix_ms=1 writer=a\n"),
            "field base_id is out of order: expected epoch \
             (the order is epoch, base_id, heartbeat_unix_ms, writer)"
        );
    }

    #[test]
    fn rejects_non_numbers_signs_and_leading_zeros() {
        let with_epoch = |e: &str| {
            err(&format!(
                "flock-epoch v1 epoch={e} base_id=7 heartbeat_unix_ms=1 writer=a\n"
            ))
        };
        assert_eq!(with_epoch("x"), "epoch is not a number: \"x\"");
        assert_eq!(with_epoch("+3"), "epoch is not a number: \"+3\"");
        assert_eq!(with_epoch("-3"), "epoch is not a number: \"-3\"");
        assert_eq!(with_epoch(""), "epoch is not a number: \"\"");
        assert_eq!(with_epoch("0x3"), "epoch is not a number: \"0x3\"");
        assert_eq!(with_epoch("03"), "epoch has a leading zero: \"03\"");
        assert_eq!(with_epoch("00"), "epoch has a leading zero: \"00\"");
        assert_eq!(
            with_epoch("4294967296"),
            "epoch is out of range: \"4294967296\" (the maximum is 4294967295)"
        );
        assert_eq!(
            err(
                "flock-epoch v1 epoch=1 base_id=7 heartbeat_unix_ms=18446744073709551616 writer=a\n"
            ),
            "heartbeat_unix_ms is out of range: \"18446744073709551616\" \
             (the maximum is 18446744073709551615)"
        );
    }

    #[test]
    fn rejects_trailing_data_and_second_record() {
        assert_eq!(
            err(&format!("{GOOD}{GOOD}")),
            format!(
                "trailing data after the record ({} bytes after the newline)",
                GOOD.len()
            )
        );
        assert!(err(&format!("{GOOD}\n")).starts_with("trailing data after the record"));
    }

    #[test]
    fn rejects_torn_write_without_newline() {
        assert_eq!(
            err(GOOD.trim_end()),
            "record is not terminated by a newline (truncated write?)"
        );
        assert_eq!(
            err(&GOOD[..20]),
            "record is not terminated by a newline (truncated write?)"
        );
    }

    #[test]
    fn rejects_control_bytes_crlf_and_non_ascii() {
        assert_eq!(
            err("flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=a\r\n"),
            "invalid byte 0x0d at offset 61: a record is one line of printable ASCII"
        );
        assert!(err("flock-epoch\tv1\n").starts_with("invalid byte 0x09 at offset 11"));
        assert!(
            EpochRecord::parse(b"flock-epoch v1 \xff\n")
                .unwrap_err()
                .to_string()
                .starts_with("invalid byte 0xff")
        );
    }

    #[test]
    fn rejects_stray_spaces() {
        assert_eq!(
            err("flock-epoch  v1\n"),
            "unexpected space at offset 12: tokens are separated by exactly one space"
        );
        assert!(err(" flock-epoch v1\n").starts_with("unexpected space at offset 0"));
        assert!(err(&GOOD.replace('\n', " \n")).starts_with("unexpected space at offset 78"));
    }

    #[test]
    fn rejects_invalid_writer() {
        assert_eq!(
            err("flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=-a\n"),
            "writer is not a valid id: \"-a\" (1 to 64 characters from A-Z a-z 0-9 . _ -, \
             starting with a letter or digit)"
        );
        assert!(
            err("flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=\n")
                .starts_with("writer is not a valid id: \"\"")
        );
        assert!(
            err("flock-epoch v1 epoch=3 base_id=7 heartbeat_unix_ms=1 writer=a=b\n")
                .starts_with("writer is not a valid id: \"a=b\"")
        );
    }

    #[test]
    fn writer_id_validation() {
        assert!(WriterId::new("flock-node-7f9c.x_1").is_ok());
        assert!(WriterId::new("w".repeat(MAX_WRITER_LEN)).is_ok());
        assert!(WriterId::new("w".repeat(MAX_WRITER_LEN + 1)).is_err());
        assert!(WriterId::new("").is_err());
        assert!(WriterId::new(".a").is_err());
        assert!(WriterId::new("a b").is_err());
        assert!(WriterId::new("é").is_err());
        assert!(WriterId::try_from("a").is_ok());
    }

    #[test]
    fn freshness_is_symmetric_around_now() {
        let r = record(); // heartbeat 1_764_400_000_123
        let hb = r.heartbeat_unix_ms;
        let before = |ms| UnixMs(hb.as_millis() - ms);
        assert!(r.is_fresh(hb, 0));
        assert!(r.is_fresh(hb.plus(1_000), 1_000));
        assert!(!r.is_fresh(hb.plus(1_001), 1_000));
        assert!(r.is_fresh(before(1_000), 1_000));
        assert!(!r.is_fresh(before(1_001), 1_000));
        assert_eq!(r.heartbeat_age(hb.plus(5)), HeartbeatAge::Ago(5));
        assert_eq!(r.heartbeat_age(before(5)), HeartbeatAge::Ahead(5));
        assert_eq!(
            r.freshness(hb.plus(1_001), 1_000).to_string(),
            "heartbeat 1001 ms old (stale; limit 1000 ms)"
        );
        assert_eq!(
            r.freshness(before(5), 1_000).to_string(),
            "heartbeat 5 ms in the future (fresh; limit 1000 ms)"
        );
    }

    #[test]
    fn stale_at_saturates() {
        let mut r = record();
        r.heartbeat_unix_ms = UnixMs(u64::MAX - 1);
        assert_eq!(r.stale_at(10), UnixMs(u64::MAX));
        assert!(r.is_fresh(UnixMs(u64::MAX), 1));
        assert!(!r.is_fresh(UnixMs::ZERO, u64::MAX - 2));
    }
}
