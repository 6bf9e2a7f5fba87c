//! Texts that many spans repeat, allocated once each: a flight recorder's
//! snapshot turns tens of thousands of driver calls into spans that name
//! the same few kernels, streams, functions and results.

use std::{fmt::Write as _, sync::Arc};

use rustc_hash::FxHashSet;

use super::Value;

/// One shared copy of each text asked for.
#[derive(Debug, Default)]
pub struct SharedTexts {
    texts: FxHashSet<Arc<str>>,
    /// Where [`Self::format`] writes before looking the text up.
    scratch: String,
}

impl SharedTexts {
    /// The shared copy of `text`.
    pub fn get(&mut self, text: &str) -> Arc<str> {
        if let Some(shared) = self.texts.get(text) {
            return Arc::clone(shared);
        }
        let shared: Arc<str> = text.into();
        self.texts.insert(Arc::clone(&shared));
        shared
    }

    /// The shared copy of the text `args` format, written first into a
    /// buffer kept for the next call.
    pub fn format(&mut self, args: std::fmt::Arguments<'_>) -> Arc<str> {
        let mut text = std::mem::take(&mut self.scratch);
        text.clear();
        // Writing to a String cannot fail.
        let _ = text.write_fmt(args);
        let shared = self.get(&text);
        self.scratch = text;
        shared
    }

    /// `text` as a stat's value.
    pub fn value(&mut self, text: &str) -> Value {
        Value::Str(self.get(text))
    }

    /// `v` in hexadecimal (`0x…`), as a stat's value.
    pub fn hex(&mut self, v: u64) -> Value {
        Value::Str(self.format(format_args!("{v:#x}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_asked_for_twice_is_one_allocation() {
        let mut texts = SharedTexts::default();
        let a = texts.get("vecAdd(float*)");
        let b = texts.format(format_args!("vecAdd({}*)", "float"));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(&*a, "vecAdd(float*)");
        let c = texts.hex(0x5a);
        assert_eq!(c, Value::Str("0x5a".into()));
        assert!(
            !Arc::ptr_eq(&a, &texts.get("0x5a"))
                && Arc::ptr_eq(&texts.get("0x5a"), &texts.get("0x5a"))
        );
    }
}
