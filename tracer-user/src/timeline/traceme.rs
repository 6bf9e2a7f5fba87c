//! TraceMe events → spans on the threads' lines, the way TSL's host tracer
//! turns its recorder's events into `/host:CPU` events:
//!
//! - a complete event (`start_time`, `end_time` > 0; equal for an instant)
//!   is one span on the thread that recorded it;
//! - an activity is recorded twice, `{name, now, -id}` when it starts and
//!   `{"", -id, now}` when it ends, possibly on another thread: the pair
//!   becomes one span on the thread that ended it, named by the start;
//!   halves without their partner are dropped, as TSL drops them;
//! - `name#k=v,...#` names are split into the event name and typed stats
//!   (int64, else uint64, else double, else string), as TSL parses them;
//! - times are wall-clock epoch ns, mapped onto the capture's monotonic
//!   timeline with its `ClockSync`; events not wholly inside the capture
//!   window are dropped (TSL drops those that began before its session).
//!
//! Spans of one thread must nest. Scoped TraceMes nest by construction;
//! activities need not, so partial overlaps are resolved deterministically
//! (by [`nest`], activities giving way):
//! a scoped event always keeps its true extent, and the activity it
//! overlaps is cut (at the scoped event's start when the activity began
//! first, else at its enclosing event's end); two overlapping events of the
//! same kind cut the later one. A cut span says by how much in its
//! `ebtrace_clipped_ns` stat.

use std::collections::{BTreeMap, HashMap};

use super::{Cuts, Nestable, Span, StatName, Stats, Timeline, Value, nest};
use crate::collect::TraceMeEvent;

/// Stat on a span whose end was moved to make it nest: nanoseconds cut.
pub use super::CLIPPED_STAT;
/// Stat on a span whose name was longer than ebtrace copies: its length.
pub const TRUNCATED_STAT: &str = "ebtrace_name_truncated_from";
/// Name of an event whose name could not be read from the target.
pub const UNREADABLE_NAME: &str = "(TraceMe name unreadable)";

/// What became of the TraceMe events of a capture.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceMeSpanStats {
    /// Spans added to the timeline.
    pub spans: u64,
    /// Activity starts and ends whose partner was not recorded.
    pub unpaired_activity_halves: u64,
    /// Events not wholly inside the capture window.
    pub outside_window: u64,
    /// Spans cut to make them nest.
    pub clipped: u64,
    /// Records with impossible times.
    pub malformed: u64,
}

/// An event name split into its name and its `#k=v,...#` metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedName {
    /// The event's name, without the metadata.
    pub name: String,
    /// The metadata, typed.
    pub stats: Vec<(StatName, Value)>,
}

/// A metadata value, typed as TSL's `ParseAndAddStatValue` types it.
pub fn parse_stat_value(value: &str) -> Value {
    if let Ok(v) = value.parse::<i64>() {
        Value::I64(v)
    } else if let Ok(v) = value.parse::<u64>() {
        Value::U64(v)
    } else if let Ok(v) = value.parse::<f64>() {
        Value::F64(v)
    } else {
        Value::Str(value.into())
    }
}

/// Splits metadata at commas outside quotes and brackets (TSL's
/// `SplitPairs`); pieces shorter than two characters are skipped.
fn split_pairs(metadata: &str) -> Vec<&str> {
    let mut pairs = Vec::new();
    let mut open: Vec<u8> = Vec::new();
    let mut start = 0;
    for (i, c) in metadata.bytes().enumerate() {
        match c {
            b'"' | b'\'' => {
                if open.last() == Some(&c) {
                    open.pop();
                } else {
                    open.push(c);
                }
            }
            b'{' | b'(' | b'[' => open.push(c),
            b'}' | b')' | b']' => {
                let opener = match c {
                    b'}' => b'{',
                    b')' => b'(',
                    _ => b'[',
                };
                if open.last() == Some(&opener) {
                    open.pop();
                }
            }
            b',' if open.is_empty() => {
                if i - start > 1 {
                    pairs.push(&metadata[start..i]);
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    if metadata.len() - start > 1 {
        pairs.push(&metadata[start..]);
    }
    pairs
}

fn parse_metadata(metadata: &str) -> Vec<(StatName, Value)> {
    split_pairs(metadata)
        .into_iter()
        .filter_map(|pair| {
            let (k, v) = pair.split_once('=')?;
            let (k, v) = (k.trim(), v.trim());
            (!k.is_empty() && !v.is_empty()).then(|| (k.to_string().into(), parse_stat_value(v)))
        })
        .collect()
}

/// Parses a TraceMe name as TSL's `ParseAnnotation` does. A `truncated`
/// name lost its closing `#`: its name is still what precedes the first
/// `#`, and its metadata the pairs complete before the cut.
pub fn parse_traceme_name(raw: &str, truncated: bool) -> ParsedName {
    if truncated {
        return match raw.split_once('#') {
            Some((name, metadata)) => {
                let mut stats = parse_metadata(metadata);
                // The last pair may have been cut.
                if !metadata.ends_with(',') {
                    stats.pop();
                }
                ParsedName {
                    name: name.trim().to_string(),
                    stats,
                }
            }
            None => ParsedName {
                name: raw.trim().to_string(),
                stats: Vec::new(),
            },
        };
    }
    let Some(body) = raw.strip_suffix('#') else {
        return ParsedName {
            name: raw.trim().to_string(),
            stats: Vec::new(),
        };
    };
    let mut parts = body.splitn(3, '#');
    let name = parts.next().unwrap_or_default().trim().to_string();
    let stats = parts.next().map(parse_metadata).unwrap_or_default();
    ParsedName { name, stats }
}

/// A span being placed, with what the nesting rules need to know.
struct Candidate {
    span: Span,
    /// Whether it is an activity (see the module doc).
    activity: bool,
}

impl Nestable for Candidate {
    fn span(&self) -> &Span {
        &self.span
    }
    fn span_mut(&mut self) -> &mut Span {
        &mut self.span
    }
    /// Activities may be cut in favour of scoped events.
    fn gives_way(&self) -> bool {
        self.activity
    }
}

/// Builds each thread's spans from the TraceMe events of a capture (any
/// order) and adds them to `timeline`, converting times with its clock.
pub fn add_traceme_spans(timeline: &mut Timeline, events: &[TraceMeEvent]) -> TraceMeSpanStats {
    let clock = timeline.clock;
    let mut stats = TraceMeSpanStats::default();
    // Activity starts by (process, recorder, id).
    let mut starts: HashMap<(u32, u64, u64), &TraceMeEvent> = HashMap::new();
    for e in events {
        if e.start_time > 0 && e.end_time < 0 {
            starts.insert((e.tgid, e.site, e.end_time.unsigned_abs()), e);
        }
    }
    let mut per_thread: BTreeMap<u32, (u32, Vec<Candidate>)> = BTreeMap::new();
    let mut paired = 0u64;
    for e in events {
        let (named, start, end, activity) = if e.start_time > 0 && e.end_time > 0 {
            (e, e.start_time, e.end_time, false)
        } else if e.start_time < 0 && e.end_time > 0 {
            match starts.get(&(e.tgid, e.site, e.start_time.unsigned_abs())) {
                Some(s) => {
                    paired += 1;
                    (*s, s.start_time, e.end_time, true)
                }
                None => {
                    stats.unpaired_activity_halves += 1;
                    continue;
                }
            }
        } else if e.start_time > 0 && e.end_time < 0 {
            continue;
        } else {
            stats.malformed += 1;
            continue;
        };
        if end < start {
            stats.malformed += 1;
            continue;
        }
        let start_ns = clock.to_monotonic_ns(start as u64);
        let end_ns = clock.to_monotonic_ns(end as u64);
        // A time before the monotonic clock's origin wraps: outside too.
        if start_ns < timeline.start_ns || end_ns > timeline.stop_ns || start_ns > end_ns {
            stats.outside_window += 1;
            continue;
        }
        let mut span = if named.name_unreadable {
            Span {
                start_ns,
                end_ns,
                name: UNREADABLE_NAME.into(),
                stats: Stats::default(),
                correlation: None,
            }
        } else {
            let parsed = parse_traceme_name(&named.name, named.truncated);
            Span {
                start_ns,
                end_ns,
                name: parsed.name.into(),
                stats: parsed.stats.into(),
                correlation: None,
            }
        };
        if named.truncated {
            span.stats
                .push((TRUNCATED_STAT.into(), Value::I64(i64::from(named.name_len))));
        }
        per_thread
            .entry(e.tid)
            .or_insert_with(|| (e.tgid, Vec::new()))
            .1
            .push(Candidate { span, activity });
    }
    stats.unpaired_activity_halves += starts.len() as u64 - paired.min(starts.len() as u64);
    for (tid, (pid, mut candidates)) in per_thread {
        stats.clipped += nest(&mut candidates, Cuts::Marked);
        stats.spans += candidates.len() as u64;
        let spans = candidates.into_iter().map(|c| c.span);
        let track = timeline.thread_track(tid, pid, || format!("thread {tid}"));
        track.spans.extend(spans);
        track
            .spans
            .sort_by_key(|s| (s.start_ns, std::cmp::Reverse(s.end_ns)));
    }
    stats
}

#[cfg(test)]
mod tests {

    use tracer_common::{RecordHeader, RecordKind};

    use super::*;
    use crate::clock::ClockSync;

    #[test]
    fn names_and_metadata_parse_like_tsl() {
        let p = parse_traceme_name(
            "train#step_num=3,lr=0.5,tag=warm,big=18446744073709551615#",
            false,
        );
        assert_eq!(p.name, "train");
        assert_eq!(
            p.stats,
            vec![
                ("step_num".into(), Value::I64(3)),
                ("lr".into(), Value::F64(0.5)),
                ("tag".into(), Value::Str("warm".into())),
                ("big".into(), Value::U64(u64::MAX)),
            ]
        );
        // No closing '#': no metadata.
        assert_eq!(parse_traceme_name("a#b=1", false).name, "a#b=1");
        // Commas inside brackets and quotes stay in the value; blanks trimmed;
        // empty keys or values and a third '#' part are ignored.
        let p = parse_traceme_name(" op #shape=[1,2], s='x,y',=3,k=,n = -7#extra#", false);
        assert_eq!(p.name, "op");
        assert_eq!(
            p.stats,
            vec![
                ("shape".into(), Value::Str("[1,2]".into())),
                ("s".into(), Value::Str("'x,y'".into())),
                ("n".into(), Value::I64(-7)),
            ]
        );
        assert_eq!(parse_traceme_name("plain", false).stats, vec![]);
        // A cut name keeps its name and the pairs before the cut.
        let p = parse_traceme_name("step#a=1,b=2,c=12", true);
        assert_eq!(p.name, "step");
        assert_eq!(
            p.stats,
            vec![("a".into(), Value::I64(1)), ("b".into(), Value::I64(2))]
        );
        assert_eq!(parse_traceme_name("xxxx", true).name, "xxxx");
    }

    fn event(tid: u32, start: i64, end: i64, name: &str) -> TraceMeEvent {
        TraceMeEvent {
            header: RecordHeader::new(RecordKind::TraceMe, 64, 0, 0),
            tid,
            tgid: 1,
            site: 0x1000,
            start_time: start,
            end_time: end,
            name: name.to_string(),
            truncated: false,
            name_len: name.len() as u32,
            name_unreadable: false,
        }
    }

    fn timeline() -> Timeline {
        Timeline::empty(1_000, 10_000, ClockSync::from_offset(1_000_000))
    }

    /// A span as (name, start, end, stats).
    type Flat = (String, u64, u64, Vec<(StatName, Value)>);

    fn spans(tl: &Timeline, tid: u32) -> Vec<Flat> {
        tl.threads[&tid]
            .spans
            .iter()
            .map(|s| {
                let stats = s.stats.iter().cloned().collect();
                (s.name.to_string(), s.start_ns, s.end_ns, stats)
            })
            .collect()
    }

    #[test]
    fn pairs_activities_across_threads_and_resolves_overlaps() {
        let w = 1_000_000; // wall = mono + offset
        let events = vec![
            event(7, w + 2_000, w + 9_000, "step#step_num=1#"),
            // Activity starts on 7 at 3000, ends on 7 at 5000, inside a
            // scoped event [4000, 6000] that began after it.
            event(7, w + 3_000, -42, "copy"),
            event(7, w + 4_000, w + 6_000, "host"),
            event(7, -42, w + 5_000, ""),
            // An activity started on 7 and ended on 8.
            event(7, w + 3_500, -43, "cross#bytes=8#"),
            event(8, -43, w + 7_000, ""),
            // Instant, unpaired end, unpaired start, before the window.
            event(7, w + 8_000, w + 8_000, "tick"),
            event(8, -99, w + 7_500, ""),
            event(8, w + 7_600, -98, "never ended"),
            event(8, w + 500, w + 1_500, "early"),
        ];
        let mut tl = timeline();
        let stats = add_traceme_spans(&mut tl, &events);
        assert_eq!(
            spans(&tl, 7),
            vec![
                (
                    "step".into(),
                    2_000,
                    9_000,
                    vec![("step_num".into(), Value::I64(1))]
                ),
                (
                    "copy".into(),
                    3_000,
                    4_000,
                    vec![(CLIPPED_STAT.into(), Value::I64(1_000))]
                ),
                ("host".into(), 4_000, 6_000, vec![]),
                ("tick".into(), 8_000, 8_000, vec![]),
            ]
        );
        assert_eq!(
            spans(&tl, 8),
            vec![(
                "cross".into(),
                3_500,
                7_000,
                vec![("bytes".into(), Value::I64(8))]
            )]
        );
        assert_eq!(
            stats,
            TraceMeSpanStats {
                spans: 5,
                unpaired_activity_halves: 2,
                outside_window: 1,
                clipped: 1,
                malformed: 0,
            }
        );
    }

    #[test]
    fn same_kind_overlaps_cut_the_later_event() {
        let w = 1_000_000;
        let events = vec![
            event(7, w + 2_000, w + 5_000, "a"),
            event(7, w + 3_000, w + 6_000, "b"),
            event(7, w + 3_000, w + 4_000, "c"),
        ];
        let mut tl = timeline();
        add_traceme_spans(&mut tl, &events);
        let got = spans(&tl, 7);
        assert_eq!(got[0].0, "a");
        assert_eq!((got[1].0.as_str(), got[1].1, got[1].2), ("b", 3_000, 5_000));
        assert_eq!(got[1].3, vec![(CLIPPED_STAT.into(), Value::I64(1_000))]);
        assert_eq!((got[2].0.as_str(), got[2].1, got[2].2), ("c", 3_000, 4_000));
    }

    #[test]
    fn truncated_and_unreadable_names_are_marked() {
        let w = 1_000_000;
        let mut cut = event(7, w + 2_000, w + 3_000, "long#a=1,b=2");
        cut.truncated = true;
        cut.name_len = 5000;
        let mut lost = event(7, w + 4_000, w + 5_000, "");
        lost.name_unreadable = true;
        let mut tl = timeline();
        add_traceme_spans(&mut tl, &[cut, lost]);
        let got = spans(&tl, 7);
        assert_eq!(got[0].0, "long");
        assert_eq!(
            got[0].3,
            vec![
                ("a".into(), Value::I64(1)),
                (TRUNCATED_STAT.into(), Value::I64(5000))
            ]
        );
        assert_eq!(got[1].0, UNREADABLE_NAME);
    }

    /// A time as a hostile target may write it: anything, but often near
    /// the window (wall = mono + 1_000_000) or at the extremes.
    fn any_time() -> impl proptest::strategy::Strategy<Value = i64> {
        use proptest::prelude::*;
        prop_oneof![
            1_000_000i64..1_011_000,
            -20i64..20,
            Just(i64::MIN),
            Just(i64::MAX),
            any::<i64>(),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        #[test]
        fn any_name_parses(raw in "\\PC{0,80}|[a-z#=,'\\[\\](){} ]{0,40}", truncated in proptest::prelude::any::<bool>()) {
            let parsed = parse_traceme_name(&raw, truncated);
            proptest::prop_assert!(parsed.name.len() <= raw.len());
            proptest::prop_assert!(parsed.stats.len() <= raw.len());
        }

        /// `name#k=v,...#` gives that name and those pairs, typed as TSL
        /// types them.
        #[test]
        fn well_formed_metadata_round_trips(
            name in "[a-zA-Z0-9_:/ ]{0,20}",
            pairs in proptest::collection::vec(("[a-z_][a-z0-9_]{0,8}", "[a-zA-Z0-9_.+-]{1,12}"), 0..6),
        ) {
            let metadata: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let raw = format!("{name}#{}#", metadata.join(","));
            let parsed = parse_traceme_name(&raw, false);
            proptest::prop_assert_eq!(parsed.name, name.trim());
            let expected: Vec<(StatName, Value)> =
                pairs.iter().map(|(k, v)| (k.clone().into(), parse_stat_value(v))).collect();
            proptest::prop_assert_eq!(parsed.stats, expected);
        }

        /// Whatever times and names the target's recorder holds, the spans
        /// lie inside the window and nest on every thread.
        #[test]
        fn hostile_events_become_nested_spans_inside_the_window(
            raw in proptest::collection::vec(
                (1u32..4, any_time(), any_time(), "[a-z#=,]{0,12}", proptest::prelude::any::<bool>()),
                0..40,
            ),
        ) {
            let events: Vec<TraceMeEvent> = raw
                .iter()
                .map(|(tid, start, end, name, unreadable)| TraceMeEvent {
                    name_unreadable: *unreadable,
                    truncated: name.len() % 3 == 0,
                    ..event(*tid, *start, *end, name)
                })
                .collect();
            let mut tl = timeline();
            let stats = add_traceme_spans(&mut tl, &events);
            let mut total = 0;
            for t in tl.threads.values() {
                for (i, a) in t.spans.iter().enumerate() {
                    proptest::prop_assert!(tl.start_ns <= a.start_ns);
                    proptest::prop_assert!(a.start_ns <= a.end_ns && a.end_ns <= tl.stop_ns);
                    for b in &t.spans[i + 1..] {
                        let apart = a.end_ns <= b.start_ns || b.end_ns <= a.start_ns;
                        let nested = (a.start_ns <= b.start_ns && b.end_ns <= a.end_ns)
                            || (b.start_ns <= a.start_ns && a.end_ns <= b.end_ns);
                        proptest::prop_assert!(apart || nested, "{a:?} / {b:?}");
                    }
                }
                total += t.spans.len() as u64;
            }
            proptest::prop_assert_eq!(stats.spans, total);
        }
    }
}
