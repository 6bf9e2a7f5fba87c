//! The Prometheus text exposition format (version 0.0.4), which every
//! scraper reads, `promtool check metrics` included. (The OpenMetrics
//! format of the `prometheus-client` crate names a counter's family
//! without its `_total`, which promtool's parser reports as samples
//! without help.)

use std::fmt::Write as _;

/// The HTTP `Content-Type` of the format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A metric family's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A value that only goes up.
    Counter,
    /// A value that goes up and down.
    Gauge,
}

/// Writes metric families one after the other.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// Starts a family: its `HELP` and `TYPE` lines. `help` is ebtrace's
    /// own text, one line.
    pub fn family(&mut self, name: &str, help: &str, kind: Kind) {
        let kind = match kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        };
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample of the family just started. Label values may come from a
    /// traced process (its name): they are escaped.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, value)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"");
                escape_into(&mut self.out, value);
                self.out.push('"');
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// The text written.
    pub fn finish(self) -> String {
        self.out
    }
}

/// A label value as the format wants it: `\`, `"` and newlines escaped.
fn escape_into(out: &mut String, value: &str) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_and_escaped_labels() {
        let mut e = Exposition::default();
        e.family("x_total", "Things.", Kind::Counter);
        e.sample("x_total", &[("pid", "1"), ("name", "a\"b\\c\nd")], 1.5);
        e.family("y", "Now.", Kind::Gauge);
        e.sample("y", &[], 2.0);
        assert_eq!(
            e.finish(),
            "# HELP x_total Things.\n# TYPE x_total counter\n\
             x_total{pid=\"1\",name=\"a\\\"b\\\\c\\nd\"} 1.5\n\
             # HELP y Now.\n# TYPE y gauge\ny 2\n"
        );
    }
}
