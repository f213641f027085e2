//! The cxx bridge: the engine client as the C++ class `kvtier::Client`.
//!
//! Sections in cxx's order: shared types, then the Rust type and its functions. The C++
//! helpers (`kvtier::error_code`, `kvtier::pack_u64`) live in `include/kvtier/client.h`
//! and `cpp/client.cc`. A failure becomes a `rust::Error` whose message starts with
//! `"[code N] "`, N being the same stable code as the C ABI's (`include/kvtier.h`). Every
//! entry runs inside [`guard`], so no panic unwinds into C++.

use super::convert::{self, ConnectFields, HintFields};
use super::{ERR_INVALID, FfiError, Handle, guard, hashes_from};
use crate::tier::tensors::KvTensors;

#[cxx::bridge(namespace = "kvtier")]
mod bridge {
    /// How to reach the daemon, who this rank is, and the model geometry.
    struct ConnectOptions {
        socket: String,
        instance: String,
        model: String,
        lora: String,
        salt: String,
        tp_rank: u16,
        tp_size: u16,
        pp_rank: u16,
        pp_size: u16,
        dp_rank: u16,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype_bytes: u32,
        page_tokens: u32,
        /// 0 MHA/GQA, 1 MLA.
        attention: u32,
        /// 0 layer-first, 1 page-first.
        byte_order: u32,
        /// Every call's timeout; 0 = 5000.
        timeout_ms: u32,
        /// `KVTIER_DTYPE_*` (0: unspecified, the byte width alone).
        dtype: u32,
        /// `KVTIER_KV_ORDER_*` (0: NHD).
        kv_order: u32,
        /// Whether `daemon_uid` is set; when false, the daemon must run as this process's uid.
        has_daemon_uid: bool,
        /// The uid the daemon runs as (checked on the socket's peer and the arena's owner).
        daemon_uid: u32,
    }

    /// Contiguous prefix of complete pages, credited to the nearest tier holding them.
    struct PrefixHit {
        device: u64,
        host: u64,
        pool: u64,
    }

    struct StoreReceipt {
        ticket: u64,
        written: u64,
        complete: u32,
    }

    struct TicketStatus {
        complete: u32,
        total: u32,
        failed: u32,
    }

    /// A hint in the numbering of `include/kvtier.h` (`KVTIER_HINT_*`, `KVTIER_TARGET_*`).
    struct HintRequest {
        kind: u32,
        target: u32,
        hashes: Vec<u8>,
        hash_len: usize,
        session: String,
        tier: u32,
        priority: i32,
        ttl_ms: u64,
        deadline_ms: u64,
    }

    /// `KVTIER_OUTCOME_*` and a hint reason (0 for none).
    struct HintResult {
        outcome: u32,
        reason: u32,
        applied: u64,
        requested: u64,
    }

    /// Token ids of the pages of a `store_tokens`: page i's are
    /// `tokens[i * tokens_per_page ..]`; `parent` is empty for none, else the `hash_len`
    /// bytes of the page before page 0 in its chain.
    struct PageTokens {
        parent: Vec<u8>,
        tokens: Vec<u32>,
        tokens_per_page: usize,
    }

    extern "Rust" {
        /// One connected engine rank.
        #[cxx_name = "Client"]
        type CxxClient;

        fn connect(opts: &ConnectOptions) -> Result<Box<CxxClient>>;
        /// The deterministic test bytes of `seed` (what `fill_page` writes per layer).
        fn pattern(seed: u64, len: usize) -> Vec<u8>;

        fn register_emulated(self: &CxxClient, pages: u32) -> Result<()>;
        /// A region on GPU `ordinal` (feature `cuda`; otherwise a device error).
        fn register_cuda(self: &CxxClient, ordinal: u32, pages: u32) -> Result<()>;
        /// The engine's own KV tensors on GPU `ordinal` (see
        /// `kvtier_register_cuda_tensors` in `kvtier.h` for the arguments).
        unsafe fn register_cuda_tensors(
            self: &CxxClient,
            ordinal: u32,
            ptrs: &[u64],
            page_stride: u64,
            pages: u32,
            stream: u64,
        ) -> Result<()>;
        /// As `register_cuda_tensors`, each page of a tensor cut into `runs` runs
        /// `run_stride` bytes apart (vLLM's heads-outside layouts; see
        /// `kvtier_register_cuda_tensor_runs` in `kvtier.h`).
        #[allow(clippy::too_many_arguments)] // one value per argument, as the C ABI
        unsafe fn register_cuda_tensor_runs(
            self: &CxxClient,
            ordinal: u32,
            ptrs: &[u64],
            page_stride: u64,
            pages: u32,
            runs: u32,
            run_stride: u64,
            stream: u64,
        ) -> Result<()>;
        /// The engine's own KV tensors in host memory, addressed as
        /// `register_cuda_tensor_runs` (`kvtier_register_host_tensor_runs` in `kvtier.h`).
        unsafe fn register_host_tensor_runs(
            self: &CxxClient,
            ptrs: &[u64],
            page_stride: u64,
            pages: u32,
            runs: u32,
            run_stride: u64,
        ) -> Result<()>;
        fn object_bytes(self: &CxxClient) -> usize;
        fn fill_page(self: &CxxClient, slot: u32, seed: u64) -> Result<()>;
        fn page_matches(self: &CxxClient, slot: u32, seed: u64) -> Result<bool>;
        fn write_object(self: &CxxClient, slot: u32, part: u32, data: &[u8]) -> Result<()>;
        fn read_object(self: &CxxClient, slot: u32, part: u32, out: &mut [u8]) -> Result<()>;

        fn lookup(self: &CxxClient, hashes: &[u8], hash_len: usize) -> Result<PrefixHit>;
        fn store(
            self: &CxxClient,
            hashes: &[u8],
            hash_len: usize,
            slots: &[u32],
            session: &str,
        ) -> Result<StoreReceipt>;
        fn load(
            self: &CxxClient,
            hashes: &[u8],
            hash_len: usize,
            slots: &[u32],
            wait_mode: u32,
            wait_ms: u32,
        ) -> Result<usize>;
        fn poll(self: &CxxClient, ticket: u64) -> Result<TicketStatus>;
        fn wait(self: &CxxClient, ticket: u64, timeout_ms: u32) -> Result<TicketStatus>;
        fn removed(self: &CxxClient, hashes: &[u8], hash_len: usize) -> Result<()>;
        /// `parent` empty for none; phase `KVTIER_PHASE_*`.
        fn session(self: &CxxClient, id: &str, parent: &str, phase: u32) -> Result<()>;
        /// A request ended: `parent` empty for none; page hashes of `hash_len` bytes each.
        fn request_end(
            self: &CxxClient,
            id: &str,
            parent: &str,
            input_length: u64,
            output_length: u64,
            hashes: &[u8],
            hash_len: usize,
        ) -> Result<()>;
        fn hint(self: &CxxClient, hint: &HintRequest) -> Result<HintResult>;
        /// `store` with each page's token ids for the KV events (see [`PageTokens`]).
        fn store_tokens(
            self: &CxxClient,
            hashes: &[u8],
            hash_len: usize,
            slots: &[u32],
            session: &str,
            tokens: &PageTokens,
        ) -> Result<StoreReceipt>;
        /// Passes on a Dynamo KvHint envelope (JSON); returns the report as JSON.
        fn kv_hints(self: &CxxClient, envelope: &str) -> Result<String>;
        /// Takes the advice for this rank's namespace, at most `max_pages` pages, as the
        /// JSON of `kvtier_take_advice` (pause and resume of sessions among it).
        fn take_advice(self: &CxxClient, max_pages: u32) -> Result<String>;
    }
}

use bridge::{ConnectOptions, HintRequest, HintResult, PageTokens, PrefixHit, StoreReceipt, TicketStatus};

/// The Rust side of `kvtier::Client`.
pub struct CxxClient(Handle);

fn batch(hashes: &[u8], hash_len: usize) -> Result<Vec<crate::page::PageHash>, FfiError> {
    if hash_len == 0 {
        return Err(FfiError::new(ERR_INVALID, "a page hash has 8 to 32 bytes, not 0"));
    }
    hashes_from(hashes, hash_len, hashes.len().div_ceil(hash_len))
}

fn connect(o: &ConnectOptions) -> Result<Box<CxxClient>, FfiError> {
    guard(|| {
        let fields = ConnectFields {
            socket: &o.socket,
            instance: &o.instance,
            model: &o.model,
            lora: &o.lora,
            salt: &o.salt,
            ranks: [o.tp_rank, o.tp_size, o.pp_rank, o.pp_size, o.dp_rank],
            geometry: [o.layers, o.kv_heads, o.head_dim, o.dtype_bytes, o.page_tokens],
            parallel: [o.tp_size, o.pp_size],
            attention: o.attention,
            byte_order: o.byte_order,
            dtype: o.dtype,
            kv_order: o.kv_order,
            timeout_ms: o.timeout_ms as u64,
            daemon_uid: o.has_daemon_uid.then_some(o.daemon_uid),
        };
        Ok(Box::new(CxxClient(Handle::connect(fields.config()?)?)))
    })
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    // Bounded: a caller asking for more than 1 GiB gets 1 GiB rather than an abort.
    guard(|| Ok(crate::tier::device::pattern(seed, len.min(1 << 30)))).unwrap_or_default()
}

impl CxxClient {
    fn register_emulated(&self, pages: u32) -> Result<(), FfiError> {
        guard(|| self.0.register_emulated(pages))
    }

    fn register_cuda(&self, ordinal: u32, pages: u32) -> Result<(), FfiError> {
        guard(|| self.0.register_cuda(ordinal, pages))
    }

    /// # Safety
    /// As `Handle::register_cuda_tensors`.
    unsafe fn register_cuda_tensors(
        &self,
        ordinal: u32,
        ptrs: &[u64],
        page_stride: u64,
        pages: u32,
        stream: u64,
    ) -> Result<(), FfiError> {
        // SAFETY: caller contract, forwarded (one run a page).
        unsafe { self.register_cuda_tensor_runs(ordinal, ptrs, page_stride, pages, 1, 0, stream) }
    }

    /// # Safety
    /// As `Handle::register_cuda_tensors`.
    #[allow(clippy::too_many_arguments)] // the bridge's signature: one value per argument
    unsafe fn register_cuda_tensor_runs(
        &self,
        ordinal: u32,
        ptrs: &[u64],
        page_stride: u64,
        pages: u32,
        runs: u32,
        run_stride: u64,
        stream: u64,
    ) -> Result<(), FfiError> {
        let tensors = KvTensors::new(ptrs.to_vec(), page_stride, pages).with_runs(runs, run_stride);
        // SAFETY: caller contract.
        guard(|| unsafe { self.0.register_cuda_tensors(ordinal, &tensors, stream) })
    }

    /// # Safety
    /// As `Handle::register_host_tensors`.
    unsafe fn register_host_tensor_runs(
        &self,
        ptrs: &[u64],
        page_stride: u64,
        pages: u32,
        runs: u32,
        run_stride: u64,
    ) -> Result<(), FfiError> {
        let tensors = KvTensors::new(ptrs.to_vec(), page_stride, pages).with_runs(runs, run_stride);
        // SAFETY: caller contract.
        guard(|| unsafe { self.0.register_host_tensors(&tensors) })
    }

    fn object_bytes(&self) -> usize {
        self.0.object_bytes()
    }

    fn fill_page(&self, slot: u32, seed: u64) -> Result<(), FfiError> {
        guard(|| Ok(self.0.emulated()?.fill_page(slot, seed)?))
    }

    fn page_matches(&self, slot: u32, seed: u64) -> Result<bool, FfiError> {
        guard(|| Ok(self.0.emulated()?.page_matches(slot, seed)?))
    }

    fn write_object(&self, slot: u32, part: u32, data: &[u8]) -> Result<(), FfiError> {
        guard(|| self.0.write_object(slot, part, data))
    }

    fn read_object(&self, slot: u32, part: u32, out: &mut [u8]) -> Result<(), FfiError> {
        guard(|| self.0.read_object(slot, part, out))
    }

    fn lookup(&self, hashes: &[u8], hash_len: usize) -> Result<PrefixHit, FfiError> {
        guard(|| {
            let h = self.0.client().lookup(&batch(hashes, hash_len)?)?;
            Ok(PrefixHit {
                device: h.device as u64,
                host: h.host as u64,
                pool: h.pool as u64,
            })
        })
    }

    fn store(&self, hashes: &[u8], hash_len: usize, slots: &[u32], session: &str) -> Result<StoreReceipt, FfiError> {
        guard(|| {
            let hashes = batch(hashes, hash_len)?;
            check_slots(hashes.len(), slots)?;
            let r = self.0.client().store(&hashes, slots, session)?;
            Ok(StoreReceipt {
                ticket: r.ticket,
                written: r.written as u64,
                complete: r.complete,
            })
        })
    }

    fn load(&self, hashes: &[u8], hash_len: usize, slots: &[u32], mode: u32, ms: u32) -> Result<usize, FfiError> {
        guard(|| {
            let hashes = batch(hashes, hash_len)?;
            check_slots(hashes.len(), slots)?;
            Ok(self.0.client().load(&hashes, slots, convert::load_wait(mode, ms)?)?)
        })
    }

    fn poll(&self, ticket: u64) -> Result<TicketStatus, FfiError> {
        guard(|| Ok(ticket_status(self.0.client().poll(ticket)?)))
    }

    fn wait(&self, ticket: u64, timeout_ms: u32) -> Result<TicketStatus, FfiError> {
        let timeout = std::time::Duration::from_millis(timeout_ms as u64);
        guard(|| Ok(ticket_status(self.0.client().wait(ticket, timeout)?)))
    }

    fn removed(&self, hashes: &[u8], hash_len: usize) -> Result<(), FfiError> {
        guard(|| Ok(self.0.client().removed(&batch(hashes, hash_len)?)?))
    }

    fn session(&self, id: &str, parent: &str, phase: u32) -> Result<(), FfiError> {
        guard(|| {
            let parent = (!parent.is_empty()).then_some(parent);
            Ok(self.0.client().session(id, parent, convert::phase(phase)?)?)
        })
    }

    fn request_end(
        &self,
        id: &str,
        parent: &str,
        input_length: u64,
        output_length: u64,
        hashes: &[u8],
        hash_len: usize,
    ) -> Result<(), FfiError> {
        guard(|| {
            let parent = (!parent.is_empty()).then_some(parent);
            let hashes = batch(hashes, hash_len)?;
            Ok(self
                .0
                .client()
                .request_end(id, parent, input_length, output_length, &hashes)?)
        })
    }

    fn hint(&self, h: &HintRequest) -> Result<HintResult, FfiError> {
        guard(|| {
            let fields = HintFields {
                kind: h.kind,
                target: h.target,
                tier: h.tier,
                ttl_ms: h.ttl_ms,
                priority: h.priority,
                deadline_ms: h.deadline_ms,
            };
            let hashes = if h.target == 2 {
                Vec::new()
            } else {
                batch(&h.hashes, h.hash_len)?
            };
            let o = self.0.client().hint(fields.hint(hashes, &h.session)?)?;
            let (outcome, applied, requested, reason) = convert::outcome(&o);
            Ok(HintResult {
                outcome,
                reason,
                applied,
                requested,
            })
        })
    }
}

impl CxxClient {
    fn store_tokens(
        &self,
        hashes: &[u8],
        hash_len: usize,
        slots: &[u32],
        session: &str,
        page_tokens: &PageTokens,
    ) -> Result<StoreReceipt, FfiError> {
        let (parent, tokens, tokens_per_page) = (
            &page_tokens.parent[..],
            &page_tokens.tokens[..],
            page_tokens.tokens_per_page,
        );
        guard(|| {
            let hashes = batch(hashes, hash_len)?;
            check_slots(hashes.len(), slots)?;
            let parent = if parent.is_empty() {
                None
            } else {
                Some(crate::page::PageHash::new(parent).map_err(|e| FfiError::new(super::ERR_INVALID, e.to_string()))?)
            };
            if tokens_per_page == 0
                || tokens_per_page > crate::client::MAX_PAGE_TOKENS
                || tokens.len() != hashes.len() * tokens_per_page
            {
                return Err(FfiError::new(
                    super::ERR_LENGTH_MISMATCH,
                    format!(
                        "{} token ids for {} pages of {tokens_per_page} (1 to {} a page)",
                        tokens.len(),
                        hashes.len(),
                        crate::client::MAX_PAGE_TOKENS
                    ),
                ));
            }
            let lists: Vec<Vec<u32>> = tokens.chunks(tokens_per_page).map(<[u32]>::to_vec).collect();
            let r = self
                .0
                .client()
                .store_with_tokens(&hashes, slots, session, parent, Some(&lists))?;
            Ok(StoreReceipt {
                ticket: r.ticket,
                written: r.written as u64,
                complete: r.complete,
            })
        })
    }

    fn kv_hints(&self, envelope: &str) -> Result<String, FfiError> {
        guard(|| {
            let r = self.0.client().kv_hints(envelope)?;
            serde_json::to_string(&r).map_err(|e| FfiError::new(super::ERR_INTERNAL, e.to_string()))
        })
    }

    fn take_advice(&self, max_pages: u32) -> Result<String, FfiError> {
        guard(|| self.0.take_advice_json(max_pages as usize))
    }
}

fn check_slots(pages: usize, slots: &[u32]) -> Result<(), FfiError> {
    if slots.len() != pages {
        return Err(FfiError::new(
            super::ERR_LENGTH_MISMATCH,
            format!("{} device slots for {pages} page hashes", slots.len()),
        ));
    }
    Ok(())
}

fn ticket_status(t: crate::protocol::TicketStatus) -> TicketStatus {
    TicketStatus {
        complete: t.complete,
        total: t.total,
        failed: t.failed,
    }
}
