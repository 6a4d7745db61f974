//! A small Python pickle writer (protocol 4 opcodes), for the PyTorch memory snapshot.
//!
//! Written here rather than taken from `serde-pickle` for two reasons. The snapshot repeats the
//! same keys, action names, categories and frame lists in every one of up to millions of trace
//! entries; pickle's memo (`MEMOIZE` once, `BINGET` after) writes each of them once, which makes
//! the file about four times smaller and faster to load, in Python and in PyTorch's viewer, and
//! `serde-pickle` has no memo. And PyTorch's viewer (`MemoryViz.js`) reads the pickle with its
//! own small unpickler: it knows a fixed set of opcodes, reads integers of more than 8 bytes as
//! `BigInt`s that its arithmetic then rejects, and spreads each `APPENDS` batch into a call's
//! arguments. So every integer is written as at most a signed 64-bit one, lists are appended in
//! batches of 1000, and only opcodes that unpickler knows are used.

use std::io::{self, Write};

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE: u8 = b'X';
const EMPTY_DICT: u8 = b'}';
const EMPTY_LIST: u8 = b']';
const MARK: u8 = b'(';
const SETITEMS: u8 = b'u';
const APPENDS: u8 = b'e';
const TUPLE2: u8 = 0x86;
const MEMOIZE: u8 = 0x94;
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';

/// Items per `APPENDS`/`SETITEMS` batch, as CPython's pickler writes them.
pub(crate) const BATCH: usize = 1000;

/// Writes pickle opcodes into a buffer, flushed to the writer as it fills.
pub(crate) struct Pickler<'w> {
    out: &'w mut dyn Write,
    buf: Vec<u8>,
    next_memo: u32,
}

impl<'w> Pickler<'w> {
    /// Starts a protocol-4 pickle.
    pub fn new(out: &'w mut dyn Write) -> Pickler<'w> {
        let mut p = Pickler {
            out,
            buf: Vec::with_capacity(1 << 20),
            next_memo: 0,
        };
        p.buf.extend_from_slice(&[PROTO, 4]);
        p
    }

    fn op(&mut self, op: u8) {
        self.buf.push(op);
    }

    /// Writes out the buffer once it holds 1 MiB.
    pub fn flush_if_full(&mut self) -> io::Result<()> {
        if self.buf.len() >= 1 << 20 {
            self.out.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    /// Ends the pickle (`STOP`) and writes everything out.
    pub fn finish(mut self) -> io::Result<()> {
        self.op(STOP);
        self.out.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }

    pub fn bool(&mut self, value: bool) {
        self.op(if value { NEWTRUE } else { NEWFALSE });
    }

    /// An integer, in the shortest form the viewer reads as a number.
    pub fn int(&mut self, value: i64) {
        if (0..=0xff).contains(&value) {
            self.buf.extend_from_slice(&[BININT1, value as u8]);
        } else if (0..=0xffff).contains(&value) {
            self.op(BININT2);
            self.buf.extend_from_slice(&(value as u16).to_le_bytes());
        } else if let Ok(v) = i32::try_from(value) {
            self.op(BININT);
            self.buf.extend_from_slice(&v.to_le_bytes());
        } else {
            self.buf.extend_from_slice(&[LONG1, 8]);
            self.buf.extend_from_slice(&value.to_le_bytes());
        }
    }

    /// An unsigned figure (address, size) as a signed 64-bit integer, saturating.
    pub fn uint(&mut self, value: u64) {
        self.int(i64::try_from(value).unwrap_or(i64::MAX));
    }

    pub fn str(&mut self, s: &str) {
        match u8::try_from(s.len()) {
            Ok(len) => self.buf.extend_from_slice(&[SHORT_BINUNICODE, len]),
            Err(_) => {
                self.op(BINUNICODE);
                let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
                self.buf.extend_from_slice(&len.to_le_bytes());
            }
        }
        let len = s.len().min(u32::MAX as usize);
        self.buf.extend_from_slice(&s.as_bytes()[..len]);
    }

    /// Stores the value on top of the stack in the memo; returns its index for [`get`](Self::get).
    pub fn memoize(&mut self) -> u32 {
        self.op(MEMOIZE);
        let index = self.next_memo;
        self.next_memo += 1;
        index
    }

    /// Pushes a memoized value again.
    pub fn get(&mut self, index: u32) {
        match u8::try_from(index) {
            Ok(i) => self.buf.extend_from_slice(&[BINGET, i]),
            Err(_) => {
                self.op(LONG_BINGET);
                self.buf.extend_from_slice(&index.to_le_bytes());
            }
        }
    }

    /// A string written once and memoized; returns its memo index.
    pub fn str_memo(&mut self, s: &str) -> u32 {
        self.str(s);
        self.memoize()
    }

    pub fn empty_dict(&mut self) {
        self.op(EMPTY_DICT);
    }

    pub fn empty_list(&mut self) {
        self.op(EMPTY_LIST);
    }

    pub fn mark(&mut self) {
        self.op(MARK);
    }

    pub fn setitems(&mut self) {
        self.op(SETITEMS);
    }

    pub fn appends(&mut self) {
        self.op(APPENDS);
    }

    pub fn tuple2(&mut self) {
        self.op(TUPLE2);
    }

    /// A list whose items `item` writes, appended in batches of [`BATCH`].
    pub fn list<T>(
        &mut self,
        items: &[T],
        mut item: impl FnMut(&mut Self, &T) -> io::Result<()>,
    ) -> io::Result<()> {
        self.empty_list();
        for chunk in items.chunks(BATCH) {
            self.mark();
            for x in chunk {
                item(self, x)?;
            }
            self.appends();
            self.flush_if_full()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_use_the_shortest_form_and_never_more_than_eight_bytes() {
        let mut out = Vec::new();
        let mut p = Pickler::new(&mut out);
        p.int(7);
        p.int(300);
        p.int(-1);
        p.int(1 << 40);
        p.uint(u64::MAX);
        p.finish().unwrap();
        let mut expected = vec![PROTO, 4, BININT1, 7, BININT2, 44, 1, BININT];
        expected.extend_from_slice(&(-1i32).to_le_bytes());
        expected.extend_from_slice(&[LONG1, 8]);
        expected.extend_from_slice(&(1i64 << 40).to_le_bytes());
        expected.extend_from_slice(&[LONG1, 8]);
        expected.extend_from_slice(&i64::MAX.to_le_bytes());
        expected.push(STOP);
        assert_eq!(out, expected);
    }

    #[test]
    fn memo_indices_count_up_and_long_indices_use_long_binget() {
        let mut out = Vec::new();
        let mut p = Pickler::new(&mut out);
        for i in 0..300 {
            assert_eq!(p.str_memo("k"), i);
        }
        p.get(3);
        p.get(299);
        p.finish().unwrap();
        let tail = &out[out.len() - 8..];
        assert_eq!(tail, &[BINGET, 3, LONG_BINGET, 43, 1, 0, 0, STOP]);
    }
}
