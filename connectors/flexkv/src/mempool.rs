//! The mempool of one tier: a fixed number of fixed-size slots, handed out densely from 0
//! (so a tier touches memory or file space only as it fills) and recycled through a free
//! list.

/// Free-slot bookkeeping for one tier.
#[derive(Debug, Clone)]
pub struct SlotPool {
    capacity: u32,
    next_fresh: u32,
    free: Vec<u32>,
}

impl SlotPool {
    /// A pool of `capacity` slots, all free.
    pub fn new(capacity: u32) -> SlotPool {
        SlotPool { capacity, next_fresh: 0, free: Vec::new() }
    }

    /// Total slots.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Slots in use.
    pub fn used(&self) -> u32 {
        self.next_fresh - self.free.len() as u32
    }

    /// A free slot, if any.
    pub fn alloc(&mut self) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        if self.next_fresh < self.capacity {
            self.next_fresh += 1;
            return Some(self.next_fresh - 1);
        }
        None
    }

    /// Returns a slot.
    pub fn release(&mut self, slot: u32) {
        debug_assert!(slot < self.next_fresh && !self.free.contains(&slot), "double free of slot {slot}");
        self.free.push(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_then_recycled() {
        let mut p = SlotPool::new(3);
        assert_eq!((p.alloc(), p.alloc(), p.alloc(), p.alloc()), (Some(0), Some(1), Some(2), None));
        p.release(1);
        assert_eq!(p.used(), 2);
        assert_eq!(p.alloc(), Some(1));
        assert_eq!(p.alloc(), None);
    }
}
