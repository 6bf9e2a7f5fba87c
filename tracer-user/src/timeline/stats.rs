//! A span's stats: those it shares with other spans, then its own. Every
//! launch of one kernel with one configuration carries the same half
//! dozen launch details, on its call and on its work: a flight recorder's
//! snapshot of tens of thousands of launches holds one copy of them.

use std::sync::Arc;

use super::{StatName, Value};

/// One stat: its name and value.
pub type Stat = (StatName, Value);

/// The stats of a span, in order.
pub type Iter<'a> = std::iter::Chain<
    std::iter::Flatten<std::option::IntoIter<&'a [Stat]>>,
    std::slice::Iter<'a, Stat>,
>;

/// A span's stats, in order: the shared ones, then its own.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    shared: Option<Arc<[Stat]>>,
    own: Vec<Stat>,
}

impl Stats {
    /// `shared` (one copy for every span that has them), then `own`.
    pub fn shared_then(shared: Arc<[Stat]>, own: Vec<Stat>) -> Self {
        Stats {
            shared: Some(shared),
            own,
        }
    }

    /// The stats it shares with other spans, if any.
    pub fn shared(&self) -> Option<&Arc<[Stat]>> {
        self.shared.as_ref()
    }

    /// The stats it holds for itself alone: those after the shared ones.
    pub fn own(&self) -> &[Stat] {
        &self.own
    }

    /// Every stat, in order.
    pub fn iter(&self) -> Iter<'_> {
        self.shared
            .as_deref()
            .into_iter()
            .flatten()
            .chain(&self.own)
    }

    /// Every stat, in order, to change: the shared ones become the span's
    /// own first.
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, Stat> {
        self.make_own();
        self.own.iter_mut()
    }

    /// The value of the first stat named `name`.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    /// Whether it holds `stat`.
    pub fn contains(&self, stat: &Stat) -> bool {
        self.iter().any(|s| s == stat)
    }

    /// How many stats it holds, shared and its own.
    pub fn len(&self) -> usize {
        self.shared.as_ref().map_or(0, |s| s.len()) + self.own.len()
    }

    /// Whether it holds no stat.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Room for `n` more stats of its own, and no more.
    pub fn reserve_exact(&mut self, n: usize) {
        self.own.reserve_exact(n);
    }

    /// Adds a stat of its own, after the others.
    pub fn push(&mut self, stat: Stat) {
        self.own.push(stat);
    }

    /// Keeps the stats `keep` returns true for, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(&Stat) -> bool) {
        if self
            .shared
            .as_ref()
            .is_some_and(|s| !s.iter().all(&mut keep))
        {
            self.make_own();
        }
        self.own.retain(keep);
    }

    /// Copies the shared stats into the span's own, before them.
    fn make_own(&mut self) {
        if let Some(shared) = self.shared.take() {
            self.own.splice(0..0, shared.iter().cloned());
        }
    }
}

impl From<Vec<Stat>> for Stats {
    fn from(own: Vec<Stat>) -> Self {
        Stats { shared: None, own }
    }
}

impl FromIterator<Stat> for Stats {
    fn from_iter<I: IntoIterator<Item = Stat>>(stats: I) -> Self {
        Vec::from_iter(stats).into()
    }
}

impl Extend<Stat> for Stats {
    fn extend<I: IntoIterator<Item = Stat>>(&mut self, stats: I) {
        self.own.extend(stats);
    }
}

impl<'a> IntoIterator for &'a Stats {
    type Item = &'a Stat;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Equal when they hold the same stats in the same order, shared or not.
impl PartialEq<Vec<Stat>> for Stats {
    fn eq(&self, other: &Vec<Stat>) -> bool {
        self.iter().eq(other.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(name: &'static str, v: i64) -> Stat {
        (name.into(), Value::I64(v))
    }

    #[test]
    fn shared_stats_come_first_and_are_copied_only_when_changed() {
        let shared: Arc<[Stat]> = vec![stat("a", 1), stat("b", 2)].into();
        let mut one = Stats::shared_then(Arc::clone(&shared), vec![stat("c", 3)]);
        let other = Stats::shared_then(Arc::clone(&shared), vec![]);
        assert_eq!(one, vec![stat("a", 1), stat("b", 2), stat("c", 3)]);
        assert_eq!(one.len(), 3);
        assert_eq!(one.get("b"), Some(&Value::I64(2)));
        // Keeping every shared stat keeps them shared.
        one.retain(|(k, _)| k != "c");
        assert_eq!(one, vec![stat("a", 1), stat("b", 2)]);
        assert_eq!(Arc::strong_count(&shared), 3);
        // Dropping one makes the rest the span's own; the others keep theirs.
        one.retain(|(k, _)| k != "a");
        assert_eq!(one, vec![stat("b", 2)]);
        assert_eq!(Arc::strong_count(&shared), 2);
        assert_eq!(other, vec![stat("a", 1), stat("b", 2)]);
        let mut changed = other.clone();
        for (_, v) in changed.iter_mut() {
            *v = Value::I64(0);
        }
        assert_eq!(changed, vec![stat("a", 0), stat("b", 0)]);
        assert_eq!(other, vec![stat("a", 1), stat("b", 2)]);
    }
}
