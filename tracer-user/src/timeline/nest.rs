//! Making one thread's spans nest: the one routine every source uses.
//!
//! The spans of a thread line must nest or follow each other (XProf draws a
//! line's events as a tree). Sources produce partial overlaps anyway:
//! driver calls whose probes fire a few ns apart, TraceMe activities that
//! begin and end on different scopes, a driver call and a TraceMe whose
//! clocks differ by a microsecond. Sorted parents-first (by start, longest
//! first), a span that outlives the span enclosing its start is cut at
//! that span's end; a span that [gives way](Nestable::gives_way) is cut
//! back instead, to the start of a span that does not. Starts never move
//! and no span grows.

use super::{CLIPPED_STAT, Span, Value};

/// What [`nest`] needs of the items it nests.
pub trait Nestable {
    /// The span to place.
    fn span(&self) -> &Span;
    /// The same, to cut.
    fn span_mut(&mut self) -> &mut Span;
    /// Whether this span is cut back to the start of a span that does not
    /// give way, starts inside it and outlives it (TraceMe activities give
    /// way to scoped events, which always keep their true extent).
    fn gives_way(&self) -> bool {
        false
    }
}

impl Nestable for Span {
    fn span(&self) -> &Span {
        self
    }
    fn span_mut(&mut self) -> &mut Span {
        self
    }
}

/// Whether a cut span says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cuts {
    /// A cut span gets a [`CLIPPED_STAT`] stat: the ns cut off, in total.
    Marked,
    /// Cuts are silent (driver calls on one thread nest by nature: an
    /// overlap is the probes' own timing, not something the user should see).
    Silent,
}

/// Makes `items` nest, sorted parents-first (see the module doc); returns
/// how many spans were cut.
pub fn nest<T: Nestable>(items: &mut [T], cuts: Cuts) -> u64 {
    items.sort_by(|a, b| {
        let key = |x: &T| {
            let s = x.span();
            (s.start_ns, std::cmp::Reverse(s.end_ns), x.gives_way())
        };
        key(a).cmp(&key(b))
    });
    // A span can be cut twice (to its parent's end, then back to a later
    // span's start): the stat says the total.
    let mut clipped_ns = vec![0u64; items.len()];
    let mut open: Vec<usize> = Vec::new();
    for i in 0..items.len() {
        let start = items[i].span().start_ns;
        loop {
            while open
                .last()
                .is_some_and(|&t| items[t].span().end_ns <= start)
            {
                open.pop();
            }
            let Some(&top) = open.last() else { break };
            let end = items[i].span().end_ns;
            let top_end = items[top].span().end_ns;
            if end <= top_end {
                break;
            }
            if items[top].gives_way() && !items[i].gives_way() {
                clipped_ns[top] += top_end - start;
                items[top].span_mut().end_ns = start;
                open.pop();
                continue;
            }
            clipped_ns[i] += end - top_end;
            items[i].span_mut().end_ns = top_end;
            break;
        }
        open.push(i);
    }
    let mut cut = 0;
    for (item, &ns) in items.iter_mut().zip(&clipped_ns) {
        if ns > 0 {
            cut += 1;
            if cuts == Cuts::Marked {
                item.span_mut()
                    .stats
                    .push((CLIPPED_STAT.into(), Value::I64(ns as i64)));
            }
        }
    }
    cut
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn span(name: &str, start_ns: u64, end_ns: u64) -> Span {
        Span {
            start_ns,
            end_ns,
            name: name.into(),
            stats: crate::timeline::Stats::default(),
            correlation: None,
        }
    }

    /// A span with its gives-way flag, as a source other than plain spans
    /// hands it over.
    #[derive(Clone, Debug)]
    struct Item {
        span: Span,
        gives_way: bool,
    }

    impl Nestable for Item {
        fn span(&self) -> &Span {
            &self.span
        }
        fn span_mut(&mut self) -> &mut Span {
            &mut self.span
        }
        fn gives_way(&self) -> bool {
            self.gives_way
        }
    }

    fn flat(spans: &[Span]) -> Vec<(&str, u64, u64)> {
        spans
            .iter()
            .map(|s| (&*s.name, s.start_ns, s.end_ns))
            .collect()
    }

    #[test]
    fn spans_from_two_sources_are_made_to_nest() {
        let mut spans = vec![
            span("traceme", 100, 200),
            // A driver call that ends 3 ns after the TraceMe enclosing it.
            span("cuLaunchKernel", 150, 203),
            span("inner", 160, 170),
            span("after", 200, 250),
            span("instant", 200, 200),
        ];
        assert_eq!(nest(&mut spans, Cuts::Marked), 1);
        assert_eq!(
            flat(&spans),
            vec![
                ("traceme", 100, 200),
                ("cuLaunchKernel", 150, 200),
                ("inner", 160, 170),
                ("after", 200, 250),
                ("instant", 200, 200),
            ]
        );
        assert_eq!(spans[1].stats, vec![(CLIPPED_STAT.into(), Value::I64(3))]);
    }

    #[test]
    fn silent_cuts_leave_no_stat() {
        let mut spans = vec![span("b", 20, 70), span("a", 10, 50)];
        assert_eq!(nest(&mut spans, Cuts::Silent), 1);
        assert_eq!(flat(&spans), vec![("a", 10, 50), ("b", 20, 50)]);
        assert!(spans.iter().all(|s| s.stats.is_empty()));
    }

    #[test]
    fn a_span_cut_twice_states_the_total_once() {
        let item = |name, start, end, gives_way| Item {
            span: span(name, start, end),
            gives_way,
        };
        let mut items = vec![
            item("scoped", 0, 100, false),
            // Cut to its parent's end (50 ns), then back to the start of
            // the scoped event that outlives it (20 ns more).
            item("activity", 50, 150, true),
            item("later scoped", 80, 120, false),
        ];
        assert_eq!(nest(&mut items, Cuts::Marked), 2);
        let spans: Vec<Span> = items.into_iter().map(|i| i.span).collect();
        assert_eq!(
            flat(&spans),
            vec![
                ("scoped", 0, 100),
                ("activity", 50, 80),
                ("later scoped", 80, 100),
            ]
        );
        assert_eq!(spans[1].stats, vec![(CLIPPED_STAT.into(), Value::I64(70))]);
        assert_eq!(spans[2].stats, vec![(CLIPPED_STAT.into(), Value::I64(20))]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// For any spans, after nesting, any two on the thread nest or
        /// follow each other; starts stay, no span grows, and the count and
        /// the stats say exactly which spans were cut and by how much.
        #[test]
        fn any_spans_nest_and_none_grows(
            raw in proptest::collection::vec((0u64..200, 0u64..120, any::<bool>()), 0..40),
            marked in any::<bool>(),
        ) {
            let mut items: Vec<Item> = raw
                .iter()
                .enumerate()
                .map(|(i, &(start, len, gives_way))| Item {
                    span: span(&i.to_string(), start, start + len),
                    gives_way,
                })
                .collect();
            let cuts = if marked { Cuts::Marked } else { Cuts::Silent };
            let cut = nest(&mut items, cuts);
            prop_assert!(items.windows(2).all(|w| w[0].span.start_ns <= w[1].span.start_ns));
            let mut shrunk = 0;
            for (i, x) in items.iter().enumerate() {
                let a = &x.span;
                let (start, len, _) = raw[a.name.parse::<usize>().unwrap()];
                prop_assert_eq!(a.start_ns, start);
                prop_assert!(a.start_ns <= a.end_ns && a.end_ns <= start + len, "{a:?} grew");
                let lost = start + len - a.end_ns;
                shrunk += u64::from(lost > 0);
                let expected = match (lost, cuts) {
                    (0, _) | (_, Cuts::Silent) => vec![],
                    (ns, Cuts::Marked) => vec![(CLIPPED_STAT.into(), Value::I64(ns as i64))],
                };
                prop_assert_eq!(&a.stats, &expected);
                for y in &items[i + 1..] {
                    let b = &y.span;
                    let apart = a.end_ns <= b.start_ns || b.end_ns <= a.start_ns;
                    let nested = (a.start_ns <= b.start_ns && b.end_ns <= a.end_ns)
                        || (b.start_ns <= a.start_ns && a.end_ns <= b.end_ns);
                    prop_assert!(apart || nested, "{a:?} / {b:?}");
                }
            }
            prop_assert_eq!(cut, shrunk);
        }
    }
}
