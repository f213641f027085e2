//! POLYVAL (RFC 8452), the universal hash under the pool objects' MAC
//! ([`super::integrity`]), fast where the CPU multiplies carry-less.
//!
//! POLYVAL over blocks `X_1..X_n` is `S_n`, where `S_0 = 0` and `S_j = (S_{j-1} ⊕ X_j) • H`,
//! `a • b = a·b·x⁻¹²⁸` in GF(2¹²⁸) modulo `x¹²⁸ + x¹²⁷ + x¹²⁶ + x¹²¹ + 1`. The product is
//! associative and linear, so `k` blocks fold as `(S ⊕ X_1)•Hᵏ ⊕ X_2•Hᵏ⁻¹ ⊕ … ⊕ X_k•H`:
//! `k` carry-less products summed unreduced and one reduction, instead of `k` products in a
//! chain each waiting on the last. With AVX-512's VPCLMULQDQ four blocks go in one
//! instruction and 64 blocks share a reduction; with VPCLMULQDQ on 256-bit vectors (AVX2
//! CPUs without AVX-512, such as AMD Zen 3), two blocks per instruction, 32 per reduction,
//! and three products per block instead of four (Karatsuba); with PCLMULQDQ alone, 8 blocks.
//! Elsewhere the `polyval` crate's portable code runs (and is the reference the tests
//! compare with).
//!
//! One 64 KiB object hashes at about the speed of a `memcpy` of it on one core (`kvtier
//! bench pool`'s `mac` row), where keyed BLAKE3 ran at under half of it.

/// A POLYVAL key `H` and the powers of it the wide paths fold with.
pub struct PolyvalKey {
    h: [u8; 16],
    #[cfg(target_arch = "x86_64")]
    fast: Option<x86::Fast>,
}

impl PolyvalKey {
    /// The key `H` (16 bytes, little-endian as RFC 8452 reads them).
    pub fn new(h: [u8; 16]) -> Self {
        Self {
            h,
            #[cfg(target_arch = "x86_64")]
            fast: x86::Fast::new(h),
        }
    }

    /// Which code hashes: `"vpclmulqdq"` (AVX-512), `"vpclmulqdq-avx2"`, `"pclmulqdq"` or
    /// `"portable"`.
    pub fn engine(&self) -> &'static str {
        #[cfg(target_arch = "x86_64")]
        if let Some(f) = &self.fast {
            return f.name();
        }
        "portable"
    }

    /// POLYVAL of the concatenation of `parts`, each zero-padded to whole blocks.
    pub fn hash_padded(&self, parts: &[&[u8]]) -> [u8; 16] {
        #[cfg(target_arch = "x86_64")]
        if let Some(f) = &self.fast {
            let mut y = [0u8; 16];
            for p in parts {
                let whole = p.len() / 16 * 16;
                f.update(&mut y, &p[..whole]);
                if whole < p.len() {
                    let mut last = [0u8; 16];
                    last[..p.len() - whole].copy_from_slice(&p[whole..]);
                    f.update(&mut y, &last);
                }
            }
            return y;
        }
        portable(&self.h, parts)
    }
}

/// The `polyval` crate's POLYVAL of `parts`, each zero-padded.
fn portable(h: &[u8; 16], parts: &[&[u8]]) -> [u8; 16] {
    use polyval::universal_hash::{KeyInit, UniversalHash};
    let mut p = polyval::Polyval::new(h.into());
    for part in parts {
        p.update_padded(part);
    }
    p.finalize().into()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use core::arch::x86_64::*;

    /// Blocks one PCLMULQDQ pass folds per reduction.
    const NARROW: usize = 8;
    /// 64-byte vectors one VPCLMULQDQ pass folds per reduction (4 blocks each): the
    /// reduction's latency is paid once per KiB (16 measured up to half again as fast as 8).
    const WIDE: usize = 16;
    /// 32-byte vectors one AVX2 VPCLMULQDQ pass folds per reduction (2 blocks each).
    const MID: usize = 16;

    /// The widest path a [`Fast`] may pick (the tests check each one the CPU has).
    #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
    pub(super) enum Widest {
        Pclmul,
        Avx2,
        Avx512,
    }

    /// The powers [`update_avx2`] multiplies by: lane `i` of `h[j]` is `H^(2 MID − 2j − i)`,
    /// and `k[j]` holds, in each lane's low 64 bits, the XOR of that power's two halves
    /// (Karatsuba's middle factor).
    struct Avx2Powers {
        h: [__m256i; MID],
        k: [__m256i; MID],
    }

    /// The powers of `H` for the paths this CPU has.
    pub(super) struct Fast {
        /// `narrow[i] = H^(i+1)`.
        narrow: [__m128i; NARROW],
        /// Lane `i` of `wide[j]` is `H^(4·WIDE − 4j − i)`: the power block `4j + i` of a
        /// pass is multiplied by. `None` without AVX-512 VPCLMULQDQ.
        wide: Option<[__m512i; WIDE]>,
        /// `None` without AVX2 VPCLMULQDQ, or where `wide` is there.
        avx2: Option<Avx2Powers>,
    }

    impl Fast {
        /// `None` where the CPU has no PCLMULQDQ.
        pub(super) fn new(h: [u8; 16]) -> Option<Self> {
            Self::with(h, Widest::Avx512)
        }

        /// Whether this CPU runs the path `w`.
        pub(super) fn has(w: Widest) -> bool {
            use std::arch::is_x86_feature_detected as has;
            has!("pclmulqdq")
                && match w {
                    Widest::Pclmul => true,
                    Widest::Avx2 => has!("avx2") && has!("vpclmulqdq"),
                    Widest::Avx512 => has!("avx512f") && has!("vpclmulqdq"),
                }
        }

        /// As [`Self::new`], no path wider than `widest` (the tests check each one).
        pub(super) fn with(h: [u8; 16], widest: Widest) -> Option<Self> {
            if !Self::has(Widest::Pclmul) {
                return None;
            }
            let wide_ok = widest >= Widest::Avx512 && Self::has(Widest::Avx512);
            let avx2_ok = !wide_ok && widest >= Widest::Avx2 && Self::has(Widest::Avx2);
            // SAFETY: PCLMULQDQ was detected just above.
            let pows = unsafe { powers(h) };
            let narrow: [__m128i; NARROW] = pows[..NARROW].try_into().expect("NARROW powers");
            // SAFETY: AVX-512F and VPCLMULQDQ were detected just above.
            let wide = wide_ok.then(|| unsafe { wide_powers(&pows) });
            // SAFETY: AVX2 was detected just above.
            let avx2 = avx2_ok.then(|| unsafe { avx2_powers(&pows) });
            Some(Self { narrow, wide, avx2 })
        }

        pub(super) fn name(&self) -> &'static str {
            match (&self.wide, &self.avx2) {
                (Some(_), _) => "vpclmulqdq",
                (None, Some(_)) => "vpclmulqdq-avx2",
                (None, None) => "pclmulqdq",
            }
        }

        /// Folds `data` (whole blocks) into `y`.
        pub(super) fn update(&self, y: &mut [u8; 16], data: &[u8]) {
            debug_assert_eq!(data.len() % 16, 0);
            match (&self.wide, &self.avx2) {
                // SAFETY: `wide` exists only where `new` detected AVX-512F and VPCLMULQDQ
                // (and PCLMULQDQ, which `narrow` needs).
                (Some(w), _) => unsafe { update_wide(w, &self.narrow, y, data) },
                // SAFETY: `avx2` exists only where `new` detected AVX2 and VPCLMULQDQ
                // (and PCLMULQDQ).
                (None, Some(m)) => unsafe { update_avx2(m, &self.narrow, y, data) },
                // SAFETY: `Fast` exists only where `new` detected PCLMULQDQ.
                (None, None) => unsafe { update_narrow(&self.narrow, y, data) },
            }
        }
    }

    /// `H^1 ..= H^(4 WIDE)`.
    ///
    /// # Safety
    /// The CPU has PCLMULQDQ.
    #[target_feature(enable = "pclmulqdq")]
    unsafe fn powers(h: [u8; 16]) -> [__m128i; 4 * WIDE] {
        let mut pows = [_mm_setzero_si128(); 4 * WIDE];
        // SAFETY: `h` is 16 readable bytes; unaligned load.
        pows[0] = unsafe { _mm_loadu_si128(h.as_ptr().cast()) };
        for i in 1..pows.len() {
            pows[i] = mul(pows[i - 1], pows[0]);
        }
        pows
    }

    /// The powers laid out for [`update_wide`]: lane `i` of vector `j` holds `H^(4 WIDE − 4j − i)`.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn wide_powers(pows: &[__m128i; 4 * WIDE]) -> [__m512i; WIDE] {
        let mut v = [_mm512_setzero_si512(); WIDE];
        for (j, w) in v.iter_mut().enumerate() {
            let mut lanes = [0u8; 64];
            for i in 0..4 {
                // SAFETY: 16 bytes at `16 i` of a 64-byte array; unaligned store.
                unsafe { _mm_storeu_si128(lanes.as_mut_ptr().add(16 * i).cast(), pows[4 * WIDE - 1 - 4 * j - i]) };
            }
            // SAFETY: 64 readable bytes; unaligned load.
            *w = unsafe { _mm512_loadu_si512(lanes.as_ptr().cast()) };
        }
        v
    }

    /// The powers laid out for [`update_avx2`].
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    unsafe fn avx2_powers(pows: &[__m128i; 4 * WIDE]) -> Avx2Powers {
        let z = _mm256_setzero_si256();
        let mut p = Avx2Powers {
            h: [z; MID],
            k: [z; MID],
        };
        for (j, (h, k)) in p.h.iter_mut().zip(&mut p.k).enumerate() {
            let (a, b) = (pows[2 * MID - 1 - 2 * j], pows[2 * MID - 2 - 2 * j]);
            *h = _mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1);
            *k = _mm256_xor_si256(*h, _mm256_shuffle_epi32(*h, 0x4E));
        }
        p
    }

    #[inline]
    #[target_feature(enable = "sse2")]
    fn x(a: __m128i, b: __m128i) -> __m128i {
        _mm_xor_si128(a, b)
    }

    /// Adds the unreduced product `a·b` into `lo`, `mid`, `hi` (its 64-bit-offset parts).
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    fn mul_acc(a: __m128i, b: __m128i, acc: &mut [__m128i; 3]) {
        acc[0] = x(acc[0], _mm_clmulepi64_si128(a, b, 0x00));
        acc[1] = x(
            acc[1],
            x(_mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10)),
        );
        acc[2] = x(acc[2], _mm_clmulepi64_si128(a, b, 0x11));
    }

    /// `(hi·x¹²⁸ ⊕ mid·x⁶⁴ ⊕ lo)·x⁻¹²⁸` reduced: POLYVAL's Montgomery reduction (the
    /// `polyval` crate's, two folds by the polynomial's low terms).
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    fn reduce([t0, t2, t1]: [__m128i; 3]) -> __m128i {
        let v0 = t0;
        let v1 = x(_mm_shuffle_epi32(t0, 0x0E), t2);
        let v2 = x(t1, _mm_shuffle_epi32(t2, 0x0E));
        let v3 = _mm_shuffle_epi32(t1, 0x0E);
        let r = |v: __m128i| x(x(_mm_srli_epi64(v, 1), _mm_srli_epi64(v, 2)), _mm_srli_epi64(v, 7));
        let l = |v: __m128i| x(x(_mm_slli_epi64(v, 63), _mm_slli_epi64(v, 62)), _mm_slli_epi64(v, 57));
        let v2 = x(x(v2, v0), r(v0));
        let v1 = x(v1, l(v0));
        let v3 = x(x(v3, v1), r(v1));
        let v2 = x(v2, l(v1));
        _mm_unpacklo_epi64(v2, v3)
    }

    #[target_feature(enable = "pclmulqdq")]
    fn mul(a: __m128i, b: __m128i) -> __m128i {
        let mut acc = [_mm_setzero_si128(); 3];
        mul_acc(a, b, &mut acc);
        reduce(acc)
    }

    /// Folds `blocks` (at most [`NARROW`]) into `acc` with one reduction.
    #[inline]
    #[target_feature(enable = "pclmulqdq")]
    fn fold(pows: &[__m128i; NARROW], acc: __m128i, blocks: &[u8]) -> __m128i {
        let n = blocks.len() / 16;
        debug_assert!((1..=NARROW).contains(&n));
        let at = |i: usize| {
            // SAFETY: block `i < n` lies in `blocks`; unaligned load.
            unsafe { _mm_loadu_si128(blocks.as_ptr().add(16 * i).cast()) }
        };
        let mut sum = [_mm_setzero_si128(); 3];
        mul_acc(x(acc, at(0)), pows[n - 1], &mut sum);
        for i in 1..n {
            mul_acc(at(i), pows[n - 1 - i], &mut sum);
        }
        reduce(sum)
    }

    /// # Safety
    /// The CPU has PCLMULQDQ.
    #[target_feature(enable = "pclmulqdq")]
    unsafe fn update_narrow(pows: &[__m128i; NARROW], y: &mut [u8; 16], data: &[u8]) {
        // SAFETY: 16 readable bytes; unaligned load.
        let mut acc = unsafe { _mm_loadu_si128(y.as_ptr().cast()) };
        for c in data.chunks(16 * NARROW) {
            acc = fold(pows, acc, c);
        }
        // SAFETY: 16 writable bytes; unaligned store.
        unsafe { _mm_storeu_si128(y.as_mut_ptr().cast(), acc) };
    }

    /// XOR of a vector's four 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn lanes(v: __m512i) -> __m128i {
        let a = _mm256_xor_si256(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
        _mm_xor_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1))
    }

    /// # Safety
    /// The CPU has PCLMULQDQ, AVX-512F and VPCLMULQDQ.
    #[target_feature(enable = "pclmulqdq,avx512f,vpclmulqdq")]
    unsafe fn update_wide(wide: &[__m512i; WIDE], narrow: &[__m128i; NARROW], y: &mut [u8; 16], data: &[u8]) {
        // SAFETY: 16 readable bytes; unaligned load.
        let mut acc = unsafe { _mm_loadu_si128(y.as_ptr().cast()) };
        let mut passes = data.chunks_exact(64 * WIDE);
        for c in &mut passes {
            let z = _mm512_setzero_si512();
            let (mut lo, mut mid, mut hi) = (z, z, z);
            for (j, h) in wide.iter().enumerate() {
                // SAFETY: vector `j < WIDE` lies in the pass's `64 WIDE` bytes; unaligned load.
                let mut d = unsafe { _mm512_loadu_si512(c.as_ptr().add(64 * j).cast()) };
                if j == 0 {
                    d = _mm512_xor_si512(d, _mm512_zextsi128_si512(acc));
                }
                lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(d, *h, 0x00));
                mid = _mm512_xor_si512(
                    mid,
                    _mm512_xor_si512(
                        _mm512_clmulepi64_epi128(d, *h, 0x01),
                        _mm512_clmulepi64_epi128(d, *h, 0x10),
                    ),
                );
                hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(d, *h, 0x11));
            }
            acc = reduce([lanes(lo), lanes(mid), lanes(hi)]);
        }
        for c in passes.remainder().chunks(16 * NARROW) {
            acc = fold(narrow, acc, c);
        }
        // SAFETY: 16 writable bytes; unaligned store.
        unsafe { _mm_storeu_si128(y.as_mut_ptr().cast(), acc) };
    }

    /// XOR of a 256-bit vector's two 128-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lanes2(v: __m256i) -> __m128i {
        _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1))
    }

    /// Two blocks per VPCLMULQDQ on 256-bit vectors, [`MID`] vectors per reduction, three
    /// products per block: `lo = a₀b₀`, `hi = a₁b₁` and `(a₀⊕a₁)(b₀⊕b₁)`, whose sum with
    /// `lo` and `hi` is the middle term (Karatsuba); the sums stay unreduced until the end
    /// of a pass, where the middle term is recovered once.
    ///
    /// # Safety
    /// The CPU has PCLMULQDQ, AVX2 and VPCLMULQDQ.
    #[target_feature(enable = "pclmulqdq,avx2,vpclmulqdq")]
    unsafe fn update_avx2(p: &Avx2Powers, narrow: &[__m128i; NARROW], y: &mut [u8; 16], data: &[u8]) {
        // SAFETY: 16 readable bytes; unaligned load.
        let mut acc = unsafe { _mm_loadu_si128(y.as_ptr().cast()) };
        let mut passes = data.chunks_exact(32 * MID);
        for c in &mut passes {
            let z = _mm256_setzero_si256();
            let (mut lo, mut mid, mut hi) = (z, z, z);
            for (j, (&h, &k)) in p.h.iter().zip(&p.k).enumerate() {
                // SAFETY: vector `j < MID` lies in the pass's `32 MID` bytes; unaligned load.
                let mut d = unsafe { _mm256_loadu_si256(c.as_ptr().add(32 * j).cast()) };
                if j == 0 {
                    d = _mm256_xor_si256(d, _mm256_zextsi128_si256(acc));
                }
                lo = _mm256_xor_si256(lo, _mm256_clmulepi64_epi128(d, h, 0x00));
                hi = _mm256_xor_si256(hi, _mm256_clmulepi64_epi128(d, h, 0x11));
                let dk = _mm256_xor_si256(d, _mm256_shuffle_epi32(d, 0x4E));
                mid = _mm256_xor_si256(mid, _mm256_clmulepi64_epi128(dk, k, 0x00));
            }
            let (lo, hi) = (lanes2(lo), lanes2(hi));
            acc = reduce([lo, x(lanes2(mid), x(lo, hi)), hi]);
        }
        for c in passes.remainder().chunks(16 * NARROW) {
            acc = fold(narrow, acc, c);
        }
        // SAFETY: 16 writable bytes; unaligned store.
        unsafe { _mm_storeu_si128(y.as_mut_ptr().cast(), acc) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 8452, Appendix A: POLYVAL of two blocks.
    #[test]
    fn the_rfc_8452_vector_and_the_portable_code_agree_at_every_length() {
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let h: [u8; 16] = hex("25629347589242761d31f826ba4b757b").try_into().unwrap();
        let x = hex("4f4f95668c83dfb6401762bb2d01a262d1a24ddd2721d006bbe45f20d3c9f362");
        let k = PolyvalKey::new(h);
        assert_eq!(k.hash_padded(&[&x]).to_vec(), hex("f7a3b47b846119fae5b7866cf5e5b77e"));
        // Lengths around every path's pass sizes, split at uneven points.
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [
            0,
            1,
            15,
            16,
            17,
            127,
            128,
            129,
            511,
            512,
            513,
            255,
            256,
            257,
            1023,
            1024,
            1025,
            2048 + 16,
            4096 + 48,
            65_536,
            65_536 + 7,
        ] {
            let d = &data[..len];
            let want = portable(&h, &[d]);
            assert_eq!(k.hash_padded(&[d]), want, "{len} bytes on {}", k.engine());
            let cut = len / 3 / 16 * 16;
            assert_eq!(
                k.hash_padded(&[&d[..cut], &d[cut..]]),
                want,
                "{len} bytes split at {cut}"
            );
        }
        #[cfg(target_arch = "x86_64")]
        for widest in [x86::Widest::Pclmul, x86::Widest::Avx2, x86::Widest::Avx512] {
            // Each path this CPU has on its own, also where a wider one would be picked.
            if !x86::Fast::has(widest) {
                continue;
            }
            let one = PolyvalKey {
                h,
                fast: x86::Fast::with(h, widest),
            };
            for len in [16, 128, 144, 496, 512, 528, 1024 + 48, 4096, 65_536, 65_536 + 16 * 5] {
                assert_eq!(
                    one.hash_padded(&[&data[..len]]),
                    portable(&h, &[&data[..len]]),
                    "{len} bytes on {} ({widest:?})",
                    one.engine()
                );
            }
        }
        assert_eq!(
            k.hash_padded(&[b"ab", b"c"]),
            portable(&h, &[b"ab", b"c"]),
            "each part is padded"
        );
    }
}
