//! A free list of equal-sized slots (the pinned CPU tier's chunk slots). Pure bookkeeping:
//! no memory, so it is tested without a GPU.

/// Why a slot could not be returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotError {
    /// An index past the last slot.
    #[error("slot {index} does not exist (the slab has {slots} slots)")]
    OutOfRange {
        /// The slot.
        index: u32,
        /// Slots in the slab.
        slots: u32,
    },
    /// A slot returned twice.
    #[error("slot {0} was returned but is not taken")]
    NotTaken(u32),
}

/// Slots `0..n`, each free or taken.
#[derive(Debug, Clone)]
pub struct SlotAllocator {
    /// Free slots; taken from the end, so the lowest indices go first.
    free: Vec<u32>,
    taken: Vec<bool>,
}

impl SlotAllocator {
    /// `n` free slots.
    pub fn new(n: u32) -> SlotAllocator {
        SlotAllocator { free: (0..n).rev().collect(), taken: vec![false; n as usize] }
    }

    /// Slots in all.
    pub fn slots(&self) -> u32 {
        self.taken.len() as u32
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Takes up to `n` slots (fewer when fewer are free).
    pub fn take(&mut self, n: usize) -> Vec<u32> {
        let keep = self.free.len().saturating_sub(n);
        let got: Vec<u32> = self.free.drain(keep..).rev().collect();
        for i in &got {
            self.taken[*i as usize] = true;
        }
        got
    }

    /// Returns a taken slot.
    pub fn give(&mut self, index: u32) -> Result<(), SlotError> {
        let slots = self.slots();
        let t = self.taken.get_mut(index as usize).ok_or(SlotError::OutOfRange { index, slots })?;
        if !*t {
            return Err(SlotError::NotTaken(index));
        }
        *t = false;
        self.free.push(index);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_lowest_first_until_empty_and_reuses_returned_slots() {
        let mut a = SlotAllocator::new(4);
        assert_eq!(a.take(3), vec![0, 1, 2]);
        assert_eq!(a.free(), 1);
        // More than free: only what there is.
        assert_eq!(a.take(5), vec![3]);
        assert!(a.take(1).is_empty());
        a.give(1).unwrap();
        a.give(3).unwrap();
        assert_eq!(a.free(), 2);
        let mut again = a.take(2);
        again.sort();
        assert_eq!(again, vec![1, 3]);
        assert_eq!(a.slots(), 4);
    }

    #[test]
    fn refuses_double_and_foreign_returns() {
        let mut a = SlotAllocator::new(2);
        let s = a.take(1);
        a.give(s[0]).unwrap();
        assert_eq!(a.give(s[0]), Err(SlotError::NotTaken(0)));
        assert_eq!(a.give(7), Err(SlotError::OutOfRange { index: 7, slots: 2 }));
        assert_eq!(a.free(), 2, "a refused return changes nothing");
        assert_eq!(a.take(0), Vec::<u32>::new());
    }
}
