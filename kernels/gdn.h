#pragma once
// CUDA kernels for the HydraHead LA heads (DESIGN.md section 9). core/attention/gdn.cpp builds the
// chunked gated delta rule around these; its LibTorch forms are the references tests/gpu compares with.
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/util/compat.h"

namespace hh::kernels {

// True when state_scan has a CUDA kernel for this state shape (Dk in {32, 64, 128}, Dv a multiple of 16)
// and dtype (float32).
bool state_scan_supported(int64_t Dk, int64_t Dv, at::ScalarType dtype);

// Which scan the gated delta rule runs (process-wide; for benchmarks): low_rank_scan below on the
// transition's factors (the default), or state_scan on the materialised transition, on the tensor cores
// (mma.sync TF32 with the 3xTF32 split, float32 accuracy) or with plain float32 FMAs.
enum class ScanKernel { kLowRank, kTensorCores, kFma };
void set_state_scan_kernel(ScanKernel k);
ScanKernel state_scan_kernel();

// The chunk-to-chunk recurrence of the chunked gated delta rule, one sequence and head per (s, h):
//   Y = y0[s, h];  for each chunk n of sequence s (first to last, or last to first when reverse):
//     hist[h, n] = Y;  Y = P[h, n]^T Y + Z[h, n]
//   final[s, h] = Y
// P [H, N, Dk, Dk], Z [H, N, Dk, Dv], y0 [S, H, Dk, Dv], all float32 CUDA and contiguous; the chunks of
// sequence s are n in [offsets[s], offsets[s + 1]) (offsets: S + 1 host values, non-decreasing, last = N).
// Writes hist (preallocated [H, N, Dk, Dv]) and returns final [S, H, Dk, Dv].
// The state's Dv columns evolve independently, so blocks split them (16 columns a block).
at::Tensor state_scan(const at::Tensor& P, const at::Tensor& Z, const at::Tensor& y0, const std::vector<int64_t>& offsets,
                      bool reverse, at::Tensor& hist);

// Which input row fills each of the N chunks' 64 slots: B regular sequences of T tokens, `per` =
// ceil(T / 64) chunks each (chunk b * per + j holds tokens 64 j .. of sequence b), or, when gather is
// defined, gather[n * 64 + r] (int64 CUDA [N * 64]; B * T marks padding). Padding slots are zero.
struct ChunkGrid {
  int64_t N = 0, per = 0;
  at::Tensor gather;
};

// The same recurrence with the transition given by chunk-local factors, never formed:
//   Y = y0[s, h];  for each chunk n of sequence s (in order, or reversed):
//     hist[h, n] = Y;  M = U[h, n] - B[h, n] Y;  M_out[h, n] = M;  Y = decay[h, n] Y + A[h, n]^T M + Z[h, n]
//   final[s, h] = Y
// i.e. P^T = decay I - A^T B. A, B [H, N, C, Dk]; decay [H, N]; U and M_out [H, N, C, Dv] and Z
// [H, N, Dk, Dv] optional (undefined: zero / not written); y0 [S, H, Dk, Dv]; hist [H, N, Dk, Dv]
// preallocated, or undefined (not written; kBlockFloat16 only). All float32 CUDA contiguous, except that A and B may both
// be float16 (values exact in TF32, half the bytes streamed per chunk), and A, B and U may be column
// slices of wider packed rows; chunk C = 64, Dk in {32, 64, 128}, Dv a multiple of 16.
// U may instead be float16 with a power-of-two scale a column (U_inv below, chunk_factors' kFloat16Columns
// form): the column scan (set_scan_warp_columns) reads only that form, and the other scans refuse it.
// The gated delta rule's forward is A = e^{G_C - G} K, B = W, U = U (M = the chunk's new values
// U - W S); its backward runs the reverse scan with A = W, B = e^{G_C - G} K, Z = the direct terms.
// Products on the tensor cores, by precision:
//   kFloat32: the 3xTF32 split (float32 accuracy);
//   kTf32: one TF32 product (for 16-bit inputs, as LibTorch's float32 GEMMs with TF32 allowed);
//   kBlockFloat16 (float16 A and B only): float16 products, Y and M rounded to float16 after scaling
//     each 16-row block by a power of two (11 significant bits per element as TF32, without float16's
//     range limit); fewer instructions a step than TF32, whose operands need converting one by one.
enum class ScanPrecision { kFloat32, kTf32, kBlockFloat16 };
struct OutputFusion;  // below
struct LowRankScanArgs {
  at::Tensor A, B, decay, U, Z, y0;
  // Every sequence starts from zero, whatever y0 holds (y0 then gives the shape only, and may be left
  // unwritten, at::empty's): the scans read a zeroed buffer kept for the device instead, so that a caller
  // without start states runs no kernel to zero them.
  bool zero_start = false;
  // With U float16: the inverse of each column's scale, U's values being U16 * U_inv [H, N, Dv] float32.
  at::Tensor U_inv;
  at::Tensor hist, M;  // outputs; undefined: not written (M optional; hist optional for kBlockFloat16 only)
  bool reverse = false;
  ScanPrecision precision = ScanPrecision::kFloat32;
  // The chunks' start states (hist's values) and new values as the block float16 products use them
  // (kBlockFloat16 only; S16 with S_inv, M16 with M_inv), for chunk_output_f16 and chunk_backward (for a
  // reverse scan, each chunk's end-state gradient and its M, which is -dM with the direct term):
  // S16 [H, N, Dk, Dv] and M16 [H, N, C, Dv] float16, each 16 x 16 block of S16 and
  // 16 x 8 tile of M16 scaled by a power of two whose inverse is in S_inv [H, N, Dk / 16, Dv / 16] and
  // M_inv [H, N, C / 16, Dv / 8] (float32). Half the bytes of hist and M, and in the form the 16-bit
  // products read. The column scan (set_scan_warp_columns) scales rows of the transposed state and new
  // values in its own products, and writes those 16-bit values in these blocks, each row brought to one
  // scale for all the blocks of a 16-column slab (S16's Dk x 16, M16's C x 16): every block's scale is
  // a power of two, and a slab's largest magnitude is in [2^14, 2^15].
  at::Tensor S16, S_inv, M16, M_inv;
  // Segments (kBlockFloat16 only): 0 scans each sequence whole, one block per column slice of its
  // state (below). A number of chunks splits each longer sequence into pieces of that many, scanned side by
  // side, each from zero a few chunks early: from the latest chunk w before the piece whose chunks
  // [w, piece) have norm bounds (bound below) with a product <= 2^-20, or from the sequence's start and
  // y0 when there is none (reverse scans mirrored). kAutoSegments picks the length for the device
  // (auto_segment_chunks). The warm-up's error in the piece's start state is then at most 2^-20 of the
  // state's norm where the warm-up began.
  // Each block of the block float16 kernel owns 32 of the state's columns where 32 divides Dv (one
  // block an SM), else 16 (two blocks an SM when segmented blocks outnumber the SMs).
  int64_t segment = 0;
  // The natural log of a bound on each chunk's transition norm (||P[h, n]||), [H, N] float32, optional:
  // segmented scans find their warm-up starts by it. Without it they take log(decay), a bound only
  // where every transition has norm <= its decay, as the gated delta rule's has under its contract
  // (L2-normalised keys, beta in [0, 2], g <= 0). chunk_factors' bound holds for any input.
  at::Tensor bound;
  // The forward's output, written by the scan itself (kBlockFloat16, forward, no Z; given o): every
  // chunk's o = Qd S_n + aq_inv Aq M_n from chunk_factors' output factors (ChunkFactors::Qd, Aq, aq_inv
  // below), formed from the block float16 start state and new values the scan's own products use, so bit
  // for bit chunk_output_f16's o from the history S16 and M16 (which need then not be written). o [B, T,
  // H, Dv] bfloat16 or float16, contiguous, written at the rows `grid` gives the chunks' slots (B
  // sequences of T tokens; padding slots are not written). One read of Qd and Aq a column slice, instead
  // of the history written, read back and a kernel of its own.
  // Given `fusion` instead of o (scan_output_fusion_supported): o, rounded to y's 16-bit dtype, through
  // the fusion norm into y as chunk_output_f16_fused writes it (fusion_norm_forward_into's formulas and
  // roundings; each row's sum of squares added in another order, so a rounded output may differ by a few
  // ulp, rarely). A segment's column blocks of a head then run as one cluster, which adds each row's sums
  // of squares through their shared memory.
  struct Output {
    at::Tensor Qd, Aq, aq_inv, o;
    ChunkGrid grid;
    int64_t B = 0, T = 0;
    const OutputFusion* fusion = nullptr;
    at::Tensor y;
  } output;
  // The reverse scan's direct term from the forward's output factors (kBlockFloat16, reverse, no Z and
  // no U; Dk 64 or 128): instead of reading Z_n = (Qd - aq_inv Aq W)^T dO_n [Dk, Dv] a chunk, the scan
  // forms it from chunk_factors' Qd, Aq and aq_inv and the output's gradient in block float16 (dO16
  // [H, N, C, Dv] float16 with one inverse scale a chunk in do_inv [H, N]: grad_to_grid_f16), as
  //   M_n = -aq_inv Aq^T dO_n - B_n Y   and   Y' = a_n Y + A_n^T M_n + Qd^T dO_n
  // (A = W, B = kdecay for the backward), each product on float16 operands in float32 sums. Z is never
  // written: a [Dk, Dv] float32 matrix a chunk against dO's [C, Dv] float16 slice.
  // Or, in dO16's and do_inv's place, dO itself ([B, T, H, Dv] bfloat16 or float16) with its `grid`: where
  // the column scan runs, dO is contiguous and 16-byte aligned, and each chunk's slots are consecutive
  // tokens (regular sequences, T a multiple of C or one sequence: reverse_scan_reads_dO_in_place), the scan
  // copies dO's tiles where they lie and scales each column of a tile (a row of dO^T over the chunk's
  // tokens) to float16 by its own power of two in registers, a finer grid than dO16's scale a chunk;
  // elsewhere low_rank_scan forms dO16 and do_inv by grad_to_grid_f16 first.
  // With dO read so, in Qd's and B's place: q and k ([B, T, H, Dk] laid out as dO, where they lie) and QK
  // (chunk_factors' qk_in_scan), as UFromV's below: the scan forms each chunk's Qd and kdecay (its B) from
  // their rows in its slot, the same bits as chunk_factors' (reverse_scan_takes_qk); B is then not given.
  struct Direct {
    at::Tensor Qd, Aq, aq_inv, dO16, do_inv;
    at::Tensor dO;
    ChunkGrid grid;
    at::Tensor q, k, QK;
  } direct;
  // U formed by the column scan itself (the forward with o written, and its float16 history if asked; no
  // fusion, no float32 history; U undefined):
  // v [B, T, H, Dv] of the inputs' 16-bit dtype where it lies (its chunks' rows found by output.grid, B and
  // T, column_scan_forms_u's conditions) and Tb [H, N, 2, kPackedLower] of v's dtype, chunk_factors'
  // T diag(beta) in two parts (UForm::kScan). Each chunk's U = (hi + lo) V, summed in float32 by the
  // warpgroups' products (both operands from shared memory), enters M = U - W S unrounded.
  // With q, k (as v: [B, T, H, Dk], where they lie) and QK (chunk_factors' qk_in_scan), with or without the
  // float16 history: the scan reads q's and k's rows too and forms each chunk's Qd and kdecay from them in
  // its slot, their rows scaled by QK and rounded to float16 as chunk_factors rounds them (the same bits);
  // A and output.Qd are then not given.
  struct UFromV {
    at::Tensor v, Tb;
    at::Tensor q, k, QK;
  } u_from_v;
};
constexpr int64_t kAutoSegments = -1;
// The minimum segment length kAutoSegments picks, in chunks, so that warm-ups stay a small share.
constexpr int64_t kMinAutoSegment = 16;
// kAutoSegments' length for `blocks` whole-sequence blocks ((Dv / columns) x H x sequences), the
// longest sequence's chunks and the blocks the device runs at once (`slots`: SMs times blocks an SM):
// floor(slots / blocks) pieces of the longest sequence (at least kMinAutoSegment chunks each), so that
// the blocks fill the device once, at most kBesideSegment chunks while a ScanBeside lives on this thread
// (below); 0 for no chunks.
int64_t auto_segment_chunks(int64_t blocks, int64_t longest, int64_t slots);
// kAutoSegments' longest piece, in chunks, for a scan that runs beside another stream's kernels (ScanBeside).
constexpr int64_t kBesideSegment = 32;
// While one lives on this thread, kAutoSegments pieces are at most kBesideSegment chunks long. A scan
// beside another stream's kernels (the hybrid layer's LA heads beside its FA heads' attention) gets SMs
// as that kernel's blocks end: many short pieces fill them as they free, where one wave of long pieces
// (the device's width, right for a scan alone) runs on after the other kernel has ended. The pieces'
// warm-ups grow with their number (v50 in docs/BENCHMARKS.md measures both).
class ScanBeside {
 public:
  ScanBeside();
  ~ScanBeside();
  ScanBeside(const ScanBeside&) = delete;
  ScanBeside& operator=(const ScanBeside&) = delete;
};
bool scan_beside();  // whether one lives on this thread
// The segment length the gated delta rule's block float16 scans use (process-wide; kAutoSegments by
// default; 0 for whole sequences, as a benchmark's comparison or a test's reference).
void set_scan_segments(int64_t chunks);
int64_t scan_segments();
// The state's columns a block of the block float16 scan owns (process-wide): 0 picks (the whole head for
// the column scan where set_scan_warp_columns takes it, else 32 where they divide Dv, else 16); 32 the
// same but never the column scan; 16 always 16; these two as a benchmark's comparison or a test's. 32
// reads each chunk's factors from shared memory once for twice the columns, the scan's limit when its
// blocks share an SM.
void set_scan_columns(int columns);
int scan_columns();
// Whether the rule's forward has its block float16 scan write the output (LowRankScanArgs::output)
// instead of handing the history to chunk_output_f16 (process-wide, on by default; off for benchmarks).
// Given the fusion norm (gdn_fused_output), the scan's o then goes through fusion_norm_forward_into.
void set_output_in_scan(bool on);
bool output_in_scan_enabled();
// Whether that scan, where it can (Dk = 128, Dv 64 or 128, no float32 history, set_scan_columns automatic),
// runs a whole head a block with 16 of the state's columns a warp and the state in registers (column_scan_kernel;
// process-wide, on by default; off, blocks of 32 columns); so does the backward's reverse scan that forms the
// direct term (LowRankScanArgs::direct, with S16 and M16). Its block float16 scales rows of the transposed
// state, so its output is the rule's to that rounding, not chunk_output_f16's bits.
void set_scan_warp_columns(bool on);
bool scan_warp_columns_enabled();
// How many times the column scan has been launched in this process: which path a forward or a backward's
// reverse scan took, for tests.
int64_t column_scan_launches();
// How many of those reverse scans read the direct term's dO where it lies (reverse_scan_reads_dO_in_place),
// for tests.
int64_t dO_in_place_scans();
// Whether the rule's forward has the column scan form each chunk's U = T diag(beta) V itself
// (LowRankScanArgs::u_from_v), from v's rows where they lie and chunk_factors' T diag(beta) (UForm::kScan),
// where it can (column_scan_forms_u); process-wide, on by default; off, chunk_factors forms U (float16 by
// columns) and the scan reads it. chunk_factors then reads no v and writes no U; the scan reads v instead of
// U, and T diag(beta) besides, with one more product a chunk (two, for its two 16-bit parts).
void set_u_in_scan(bool on);
bool u_in_scan_enabled();
// Whether a forward of these shapes takes that path: the switch on; the column scan with o written
// (column_scan_takes, not through the fusion), its products by warpgroup (scan_wgmma_enabled and
// scan_wgmma_available); v [B, T, H, Dv] contiguous and 16-byte aligned of a 16-bit dtype, each chunk's
// slots consecutive tokens (grid regular, T a multiple of 64 or B = 1: rows past the last token lie beyond
// the tensor, which the copy engine reads as zeros), within the copy engine's 32-bit row coordinate.
bool column_scan_forms_u(int64_t Dk, const at::Tensor& v, const ChunkGrid& grid);
// How many column scans have formed U from v (for tests: the path taken).
int64_t u_in_scan_launches();
// Whether such a forward (one where column_scan_forms_u holds, which its callers have asked already) also has
// the scan form Qd = scale e^G q and kdecay = e^{G_C - G} k itself from q's and k's rows where they lie
// (UFromV::q, k, QK): the switch on, and q and k laid out as v; process-wide, on by default. chunk_factors then
// writes neither (268 MB less at B1 T32K H16 Dk 128); the scan reads q and k instead, and scales their rows
// in its slot. A forward kept for the backward (with the history and T) does so too, and its backward's
// reverse scan forms them in the same way (Direct::q, k, QK) where reverse_scan_takes_qk holds: Dk = 128,
// the products by warpgroup, q and k laid out as dO (which it then reads where it lies); not the switch,
// which the forward has read.
void set_qk_in_scan(bool on);
bool qk_in_scan_enabled();
bool column_scan_reads_qk(int64_t Dk, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ChunkGrid& grid);
bool reverse_scan_takes_qk(int64_t Dk, const at::Tensor& q, const at::Tensor& k, const at::Tensor& dO, const ChunkGrid& grid);
// How many column scans have read q and k where they lie (for tests: the path taken).
int64_t qk_in_scan_launches();
// The piece length, in chunks, that the last block float16 scan on this thread cut its sequences into
// (0: whole sequences): which segmentation a scan took (a ScanBeside's shorter pieces), for tests.
int64_t last_scan_piece_chunks();
// For tests: the block float16 scans run every piece of their sequences (-1, the default), or only the
// pieces whose place in their sequence (0 for its first piece) has parity 0 or 1, leaving the others'
// chunks unwritten. A piece's warm-up scans chunks of the pieces before it (reverse: after it) and must
// write none of them; with every piece run, the owning piece usually writes last and hides such a
// write, where a run of every other piece shows it. A sequence whose last piece is left out has no
// final state (its fin entry is left as allocated).
void set_scan_pieces_of_parity(int parity);
int scan_pieces_of_parity();
// Whether the column scan applies the fusion norm itself where it takes a fused output (process-wide, off
// by default: the fusion kernel after it ran faster in the layer): a row's sum of squares spans one block,
// so no cluster, but the norm's work and a barrier a chunk sit on the scan's warps. set_fusion_in_scan(true)
// takes the cluster of column blocks instead.
void set_fusion_in_column_scan(bool on);
bool fusion_in_column_scan_enabled();
// Whether the column scan's products, where it writes o (not through the fusion) and in the backward's
// reverse scan, run by warpgroup (wgmma: each chunk's factors read from shared memory once for four warps)
// instead of by warp (mma.sync on ldmatrix fragments: once a warp). Process-wide, on by default; off as a
// benchmark's comparison or a test's reference. Both sum the same operands in the same order of 16-deep
// steps: the same bits.
// Only where the device runs code built for sm_90a (scan_wgmma_available); a build for plain sm_90 keeps
// the products by warp.
void set_scan_wgmma(bool on);
bool scan_wgmma_enabled();
// Whether the current device's code has the warpgroup products (asked of the device once, by a one-thread
// kernel: which of a build's architectures it runs is the driver's choice).
bool scan_wgmma_available();
// Whether a fused output at these head sizes goes through the column scan (the switches above, Dk = 128,
// Dv 64 or 128): gdn's forward then hands the scan its fusion (LowRankScanArgs::Output::fusion).
bool column_scan_fuses(int64_t Dk, int64_t Dv);
// Whether the forward's scan with its output, at these head sizes, is the column scan under the switches
// above: `fused` where the scan takes the fusion norm (column_scan_fuses), else with o written (and, for a
// backward, the float16 history S16 and M16). gdn's forward then asks chunk_factors for U in float16
// (UForm::kFloat16Columns), the form the column scan reads.
bool column_scan_takes(int64_t Dk, int64_t Dv, bool fused);
// Whether the rule's backward has its reverse scan form the direct term (LowRankScanArgs::direct) from
// the forward's output factors, which the forward then keeps for it, instead of chunk_state_direct's Z
// (process-wide, on by default; off for benchmarks, or to keep less for the backward: the forward then
// also keeps Qd, Aq and its scan's M16 for it, 40 KB a chunk and head at Dk = Dv = 128, and
// chunk_backward reads M and dM from the two scans).
void set_direct_in_scan(bool on);
bool direct_in_scan_enabled();
// Whether the scan can also apply the fusion norm to the output it writes (LowRankScanArgs::output's
// fusion): Dk = 128 and Dv a multiple of 32 up to 256 (a cluster of Dv / 32 blocks), with 32 of the
// state's columns a block (not set_scan_columns(16)).
bool scan_output_fusion_supported(int64_t Dk, int64_t Dv);
// Whether the forward takes that path where it can (process-wide; off by default: on an H200 the layer
// with it takes the same time and energy sustained as the scan then the fusion kernel at 128K, and a
// little longer at 32K, where whole clusters place fewer blocks, BENCHMARKS.md v47; the fusion kernel
// after the scan otherwise).
void set_fusion_in_scan(bool on);
bool fusion_in_scan_enabled();
// The blocks of that scan the current device runs at once for Dv = 32 cs: whole clusters of cs blocks,
// as many as it places together (cudaOccupancyMaxActiveClusters; a GPC whose SMs are not a multiple of
// cs leaves some idle). The scan's automatic segments fill these.
int64_t fused_scan_slots(int cs);
// How many times that scan has been launched in this process (every launch, on any device): which path
// a forward took, for tests.
int64_t fused_scan_launches();
bool low_rank_scan_supported(int64_t C, int64_t Dk, int64_t Dv);
at::Tensor low_rank_scan(const LowRankScanArgs& args, const std::vector<int64_t>& offsets);  // returns final
// Whether low_rank_scan reads args.direct.dO where it lies (the column scan, with each chunk's slots
// consecutive rows of dO), rather than bringing it to the chunk grid first.
bool reverse_scan_reads_dO_in_place(const LowRankScanArgs& args);

// The chunk-local halves of the forward for 16-bit inputs, around low_rank_scan (kernels/gdn_chunk.cu):
// one block per (chunk, head) reads q, k, v, g and beta in their [B, T, H, ...] layout. Chunk C = 64;
// Dk and Dv in {64, 128}; q, k, v bfloat16 or float16 (one dtype); g and beta [B, T, H] float32 (chunk_output
// and chunk_state_direct: g float32 only); all contiguous CUDA tensors. chunk_factors also takes g and beta
// in q's dtype, each converted to float32 where it is read, so that a caller's 16-bit gates need no
// conversion kernel first: the same bits as converting them before the call.
bool chunk_forward_supported(int64_t Dk, int64_t Dv, at::ScalarType dtype);

// The factors of every chunk's transition and update, float32 on the chunk grid: with G = the chunk's
// cumulative sum of g, L[t, i] = beta_t e^{G_t - G_i} k_t.k_i (i < t) and T = (I + L)^{-1},
//   W = T diag(beta e^G) K, U = T diag(beta) V  [H, N, 64, Dk / Dv];  kdecay = e^{G_C - G} K;  decay = e^{G_C} [H, N]
// (A = kdecay, B = W, U, decay of low_rank_scan's forward), and low_rank_scan's bound
//   bound = G_C + sum_t log max(1, |1 - beta_t k_t.k_t|)  [H, N] float32,
// the log of a bound on the norm of the chunk's transition prod_t e^{g_t} (I - beta_t k_t k_t^T) for
// any keys and beta (each factor's norm is e^{g_t} max(1, |1 - beta_t |k_t|^2|)); it is G_C under the
// contract. W and kdecay are float16: float16 keeps
// TF32's 10 mantissa bits and is what the block float16 scan multiplies, at half the bytes (their
// entries are bounded by |k| times T's, far inside float16's range for the L2-normalised keys of the
// LA heads); U and decay are float32.
// Given q (of k's shape and dtype), also the output's factors that chunk_output_f16 reads:
//   Qd = scale e^G Q  [H, N, 64, Dk] float16;
//   Aq = s (scale Q K^T * e^{G_t - G_i}, i <= t, else 0)  [H, N, kPackedLower] float16, aq_inv = 1 / s [H, N]
// with s the power of two that puts the chunk's largest |entry| in [2^14, 2^15) (float16's 11
// significant bits for every entry, as TF32 keeps, and no overflow). Qd's entries are bounded by |q|
// as W's are by |k|. Aq is packed: a chunk's 64 x 64 matrix without its six 16 x 16 blocks above the
// diagonal, which are zero (kPackedLower below); the scans' copies fill those blocks with zeros as they land.
// U's form: kFloat32, or kFloat16Columns, U [H, N, 64, Dv] float16 with one power of two a column of each
// chunk, U = U16 * U_inv (U_inv [H, N, Dv] float32): each column's largest |entry| scaled into [2^14, 2^15)
// (floored at 2^-10, so that no scale passes 2^24). Half U's bytes, written here and read by the column
// scan, at float16's 11 significant bits a column (the scan's products round S and M to as many).
// kScan: no U; instead T diag(beta) = (I + L)^{-1} diag(beta) (ChunkFactors::Tb) for the column scan that
// forms U itself (LowRankScanArgs::u_from_v): two parts of k's 16-bit dtype, hi = round(x) and lo =
// round(x - hi), each packed (kPackedLower), so that hi + lo holds about 16 significant bits. chunk_factors
// then reads no v. With q, without the short convolution, and not with chunks in turn.
enum class UForm { kFloat32, kFloat16Columns, kScan };
// The packed form of a chunk's 64 x 64 matrix that is zero above its diagonal 16 x 16 blocks
// (ChunkFactors::Aq and T16): only the blocks on and below the diagonal, block row b (0..3) as 16 rows of
// its first 16 (b + 1) columns, row after row, and the four block rows one after another from
// packed_lower_row(b): 2,560 values a chunk where the whole matrix has 4,096 (chunk_output_f16, the scans
// that form the output or the direct term, and chunk_backward read these forms).
constexpr int64_t kPackedLower = 2560;
constexpr int64_t packed_lower_row(int b) { return 128 * b * (b + 1); }
struct ChunkFactors {
  at::Tensor W, U, kdecay, decay, bound;
  at::Tensor U_inv;           // kFloat16Columns only
  at::Tensor Qd, Aq, aq_inv;  // only given q
  at::Tensor T16;             // only given q and keep_t (below), packed (kPackedLower)
  at::Tensor Tb;              // UForm::kScan only (then no U): [H, N, 2, kPackedLower] of k's dtype, hi then lo
  at::Tensor QK;              // qk_in_scan only (then no Qd, no kdecay): [H, N, 2, 64] float32, scale e^{G_t} then e^{G_C - G_t}
};
// Given `conv` (with q, Dk = Dv, on a grid of regular sequences: short_conv_fusion_supported), k, v and
// q are the LA heads' projections before their short convolution, and each block forms its chunk's
//   q = causal_conv_silu_rope_l2norm(q, conv->wq, cos, sin, Dk, eps), k likewise,
//   v = causal_conv_silu(v, conv->wv)
// itself (bit for bit, as [B, T, H D] with H D channels): the convolved tensors are never written to
// memory. short_conv_apart below forms the same values with kernels of their own.
struct ShortConvInputs {
  at::Tensor wq, wk, wv;  // [H Dk, 1, 4], [H Dk, 1, 4], [H Dv, 1, 4] of the inputs' dtype, contiguous
  at::Tensor cos, sin;    // [T, Dk] of the inputs' dtype: RoPE's tables at positions 0 .. T - 1
  double eps = 1e-6;      // the L2 norm's
};
bool short_conv_fusion_supported(int64_t Dk, int64_t Dv, at::ScalarType dtype);
// With keep_t (and q, without conv), T16 [H, N, kPackedLower] of k's dtype: every chunk's T = (I + L)^{-1}
// (unit lower triangular), rounded and packed, for chunk_backward, which then reads it instead of forming
// it again.
// With qk_in_scan (UForm::kScan, with or without keep_t): neither Qd nor kdecay, but the scales of their rows, QK
// [H, N, 2, 64] float32 (scale e^{G_t}, then e^{G_C - G_t}), for the column scan that forms both itself from
// q's and k's rows where they lie (LowRankScanArgs::UFromV::q): Qd = QK[.., 0, t] q_t and kdecay =
// QK[.., 1, t] k_t rounded to float16, the same bits as chunk_factors' own.
ChunkFactors chunk_factors(const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                           const ChunkGrid& grid, const at::Tensor& q = {}, double scale = 1.0,
                           const ShortConvInputs* conv = nullptr, UForm u_form = UForm::kFloat32, bool keep_t = false,
                           bool qk_in_scan = false);

// Every chunk's output from its start state S [H, N, Dk, Dv] and new values M [H, N, 64, Dv] (low_rank_scan's
// hist and M_out): o_t = scale (e^{G_t} q_t S + sum_{i <= t} e^{G_t - G_i} (q_t.k_i) M_i), as [B, T, H, Dv] of q's dtype.
at::Tensor chunk_output(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& S,
                        const at::Tensor& M, const ChunkGrid& grid, double scale);

// chunk_output from low_rank_scan's block float16 history (S16, S_inv, M16, M_inv) and chunk_factors'
// output factors (f.Qd, f.Aq, f.aq_inv): o = Qd S + aq_inv Aq M, the same o as chunk_output's, as
// [B, T, H, Dv] of `dtype` (bfloat16 or float16) over the grid's B sequences of T tokens; products on
// the float16 values with each block's scale applied to its float32 partial sum.
at::Tensor chunk_output_f16(const ChunkFactors& f, const at::Tensor& S16, const at::Tensor& S_inv, const at::Tensor& M16,
                            const at::Tensor& M_inv, const ChunkGrid& grid, int64_t B, int64_t T, at::ScalarType dtype);

// The chunk-local half of the backward for 16-bit inputs (kernels/gdn_chunk_backward.cu), on either side
// of the reverse low_rank_scan, for the shapes and dtypes of chunk_forward_supported. dO [B, T, H, Dv]
// of q's dtype is the output's gradient as given; both take the output scale and apply it themselves.
// chunk_state_direct: every chunk's direct term of the state gradient (the reverse scan's Z),
//   Z_n = (diag(e^G) Q - A W)^T (scale dO_n)  [H, N, Dk, Dv] float32,
// with A = (Q K^T * e^{G_t - G_i}, i <= t) and W chunk_factors' (float16).
at::Tensor chunk_state_direct(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& W,
                              const at::Tensor& dO, const ChunkGrid& grid, double scale);
// grad_to_grid_f16: the output's gradient on the chunk grid in block float16 for the reverse scan's
// direct term (LowRankScanArgs::direct): dO16 [H, N, C, Dv] float16 (padding slots zero) with
// dO = do_inv[h, n] dO16[h, n] on chunk n's slots, do_inv [H, N] a power of two (float32). One scale a
// chunk and head keeps every 16-bit input exactly whose magnitude is within 2^-28 of the chunk's largest.
struct GridF16 {
  at::Tensor x16, inv;
};
GridF16 grad_to_grid_f16(const at::Tensor& dO, const ChunkGrid& grid);
// chunk_backward: given every chunk's start state S and end-state gradient dS in block float16 (the
// forward scan's S16 / S_inv and the reverse scan's, LowRankScanArgs), the gradients of
// sum_n <scale dO_n, O_n> + <dS_n, S_{n+1}> through the chunk-local function with S and dS held fixed:
// dq, dk, dv like q, k, v; dg and dbeta [B, T, H] in g's and beta's dtypes, rounded where stored (sums
// in float32). Its products take 16-bit operands of q's kind. g and beta as chunk_factors takes them:
// float32, or q's dtype converted where read (with chunks in turn, a 16-bit gate's read waits for its
// load; a float32 one is copied by cp.async).
// core/attention/gdn.cpp's chunk_local_backward is the reference.
struct ChunkInputGrads {
  at::Tensor dq, dk, dv, dg, dbeta;
};
// Given also every chunk's new values M (the forward scan's M16 / M_inv) and the reverse scan's, which
// are -dM when that scan formed the direct term (LowRankScanArgs::direct; dM16 / dM_inv), it reads M and
// dM instead of forming X = diag(beta) (V - diag(e^G) K S), M = T X and dM = diag(kd) K dS + A^T scale dO
// itself, and takes dL = -(dVb M^T) in place of -(T^T dT T^T): the same gradient with fewer products.
// Given also T16 (chunk_factors' with keep_t; with M and dM only), it reads every chunk's T instead of
// inverting I + L again.
ChunkInputGrads chunk_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                               const at::Tensor& beta, const at::Tensor& S16, const at::Tensor& S_inv,
                               const at::Tensor& dS16, const at::Tensor& dS_inv, const at::Tensor& dO,
                               const ChunkGrid& grid, double scale, const at::Tensor& M16 = {}, const at::Tensor& M_inv = {},
                               const at::Tensor& dM16 = {}, const at::Tensor& dM_inv = {}, const at::Tensor& T16 = {});
// How many times chunk_backward has run each of its forms in this process (index 0: M and dM formed in
// the kernel; 1: read from the scans; 2: T read from the forward too): which path a backward took, for tests.
std::array<int64_t, 3> chunk_backward_launches();
// Whether chunk_backward's form that reads T (Dk = Dv = 128) runs one block an SM taking chunks in turn,
// each chunk's loads landing during the chunk before, instead of one block a chunk (process-wide, off by
// default: slower, docs/BENCHMARKS.md v59). The two give the same gradients up to the order of float32 sums.
void set_backward_chunks_in_turn(bool on);
bool backward_chunks_in_turn_enabled();
// How many of chunk_backward's runs in this process took chunks in turn: which kernel ran, for tests.
int64_t backward_chunks_in_turn_launches();

// Whether the gated delta rule's forward uses chunk_factors / chunk_output where they apply
// (process-wide, on by default; off for benchmarks of the LibTorch chunk-local path).
void set_chunk_kernels(bool on);
bool chunk_kernels_enabled();
// Whether the rule's scans for 16-bit inputs run kBlockFloat16 products on float16 factors (the
// forward on the chunk kernels' factors, the backward's reverse scan on its own, converted), or kTf32
// (process-wide, on by default; off for benchmarks, and where the current device lacks the copy engine
// that scan streams its factors with).
void set_block_f16_scan(bool on);
bool block_f16_scan_enabled();
// Whether the current CUDA device has Hopper's copy engine and its barriers (compute capability 9.0 or
// later), which the block float16 scan needs.
bool copy_engine_available();
// Whether the forward's block float16 scan hands the output its float16 history (chunk_output_f16, on
// chunk_factors' output factors) or its float32 one (chunk_output) (process-wide, on by default; off
// for benchmarks).
void set_f16_history(bool on);
bool f16_history_enabled();
// Whether gdn_fused_output lets chunk_factors apply the LA heads' short convolution when given one
// (ShortConvInputs), or runs the convolution's own kernels first (process-wide, on by default; off for
// benchmarks).
void set_conv_in_factors(bool on);
bool conv_in_factors_enabled();
// Whether chunk_factors with the convolution inside runs four blocks an SM (at most 64 registers a
// thread) instead of three for bfloat16 with Dk = Dv = 128, where the four fit without spilling
// (process-wide, on by default; off for benchmarks).
void set_factors_four_blocks(bool on);
bool factors_four_blocks_enabled();
// At most n blocks of chunk_factors an SM (its dynamic shared memory padded to an SM's share, 1 <= n <= 32;
// 0, the default: as many as fit), process-wide, for benchmarks: how its chunks' time grows as fewer
// share an SM tells what a kernel forming each chunk's factors where it scans could expect. The padding
// changes no result. factors_resident_blocks: the blocks an SM the last chunk_factors launch could hold
// (asked of the device when called; 0 before any launch).
void set_factors_blocks_per_sm(int n);
int factors_blocks_per_sm();
int factors_resident_blocks();
// The current CUDA device's SMs.
int device_sms();
// chunk_factors with q (no convolution) as n blocks an SM (1 or 2) taking chunks in turn, each chunk's rows
// and gates loaded during the chunk before, instead of one block a chunk (0, the default); process-wide,
// for benchmarks: what forming a chunk's factors costs an SM that keeps one or two chunks in flight, as a
// kernel forming them where it scans would. The same bits either way. factors_in_turn_launches counts
// that kernel's launches.
void set_factors_in_turn(int blocks_an_sm);
int factors_in_turn();
int64_t factors_in_turn_launches();
// With the clocks on (process-wide, for benchmarks), chunk_factors taking chunks in turn times each chunk's
// phases on the SM's clock, at the barriers that end them: Aq, Qd and L (the grams); L's inverse (and
// kdecay, decay and the bound); W, then the wait for V; T diag(beta) split for U's product; U, then the next
// chunk's gates and rows in place (a block's last chunk: U alone). factors_turn_phases: the last such
// launch's mean cycles a chunk in each, over the chunks whose rows landed during the one before (all but
// each block's first; chunks 0 without a launch since the clocks went on).
constexpr int kFactorsPhases = 5;
struct FactorsPhases {
  int64_t chunks = 0;
  double cycles[kFactorsPhases] = {};
};
void set_factors_phase_clocks(bool on);
FactorsPhases factors_turn_phases();

// The copies between B regular sequences and the chunk grid of the rule's LibTorch backward, as one
// pass each with 16-byte accesses (core/attention/gdn.cpp's to_chunks / from_chunks, whose permuting
// copies with a dtype change are the reference):
//   to_chunk_grid:   x [B, T, H, D] bfloat16 / float16 -> [H, B * per, C, D] float32 times scale,
//                    per = ceil(T / C), padding slots zero;
//   from_chunk_grid: y [H, B * per, C, D] float32 -> [B, T, H, D] of dtype (bfloat16 / float16) times scale.
// Contiguous CUDA tensors with D a multiple of 8 (chunk_grid_copy_supported).
bool chunk_grid_copy_supported(int64_t D, at::ScalarType sixteen_bit);
at::Tensor to_chunk_grid(const at::Tensor& x, int64_t C, double scale);
at::Tensor from_chunk_grid(const at::Tensor& y, int64_t B, int64_t T, at::ScalarType dtype, double scale);

// out[...] = sum_i a[..., i] b[..., i] for a and b of one shape (float32, contiguous, CUDA): the row dot
// products of the rule's backward in one pass over both, instead of a product tensor and a reduction.
// One warp a row (16-byte loads where the rows allow them), float32 sums in a different order than
// LibTorch's. Returns a.sizes() without the last dimension.
at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b);

// T = (I + L)^{-1} for strictly lower triangular L [..., C, C] float32 contiguous, C <= 64, by forward
// substitution (one block a matrix, one thread a column). Returns T, unit lower triangular.
at::Tensor unit_lower_inverse(const at::Tensor& L);

// The LA heads' short convolution without a cache, for inference: depthwise over time, causal (inputs
// before the first token are zero), 4 taps, then SiLU:
//   y[b, t, c] = silu(to_dtype(sum_j weight[c, 0, j] x[b, t - 3 + j, c]))
// x [B, T, C] contiguous (float32, float16, bfloat16), weight [C, 1, 4] of x's dtype contiguous. The
// reference is at::conv1d (groups = C) then at::silu (core/attention/hybrid.cpp, short_conv).
at::Tensor causal_conv_silu(const at::Tensor& x, const at::Tensor& weight);
// Its backward for training: given dy = dL/dy (contiguous, x's shape and dtype), returns (dx, dweight),
// dweight [C, 1, 4] summed in float32 over every sequence and step and rounded once to x's dtype; the
// SiLU's gradient rounded to the dtype as at::silu_backward rounds it, and dx in float32 rounded once.
std::pair<at::Tensor, at::Tensor> causal_conv_silu_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight);

// The LA heads' q or k without a cache, for inference, in one pass: the short convolution above, then
// RoPE and each head's L2 norm as rope_l2norm (kernels/fused_ops.h) forms them, the convolution's
// output never stored:
//   y = rope_l2norm(causal_conv_silu(x, weight).view({B, T, C / Dh, Dh}), cos, sin, eps)
// bit for bit where rope_l2norm takes its 16-byte path. x [B, T, C] contiguous (float32, float16,
// bfloat16), weight [C, 1, 4], cos and sin [T, Dh] of x's dtype, all 16-byte aligned; C a multiple of Dh
// and Dh / V a power of two <= 32 with V = 16 bytes of elements and Dh / V even (conv_rope_l2norm_supported:
// Dh in {16, 32, 64, 128, 256} for 16-bit x, {8, .., 128} for float32). Returns [B, T, C / Dh, Dh].
bool conv_rope_l2norm_supported(int64_t C, int64_t Dh, at::ScalarType dtype);
at::Tensor causal_conv_silu_rope_l2norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                                        const at::Tensor& sin, int64_t Dh, double eps);

// The LA heads' q, k and v [B, T, H, D] (any layout) through the short convolution as kernels of their
// own: causal_conv_silu_rope_l2norm for q and k where its shapes and alignment allow, else
// causal_conv_silu then rope_l2norm; causal_conv_silu for v. The values chunk_factors forms inside given
// `c`, for where it cannot. Returns them contiguous, [B, T, H, D].
struct ConvolvedQkv {
  at::Tensor q, k, v;
};
ConvolvedQkv short_conv_apart(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ShortConvInputs& c);

// The scale-normalised fusion of every head's output (DESIGN.md section 9), rows of Dh elements:
//   y = to_dtype(gate * to_dtype(gamma * to_dtype(o * rsqrt(mean(o^2) + eps))))
// rounding where the LibTorch op sequence (model::rms_norm, then two products) rounds. o, gate [R, n, Dh]
// contiguous in one dtype (float32, float16, bfloat16), gamma [n, Dh]; row r of o uses gamma[r % n].
at::Tensor fusion_norm_forward(const at::Tensor& o, const at::Tensor& gate, const at::Tensor& gamma, double eps);

// The same forward with the gate's activation inside, each head's result written into its place in a
// wider output: for head i of o, y[b, t, heads[i]] = fusion of o[b, t, i] with act(gate[b, t, i Dh ..
// (i + 1) Dh]), act computed in float32 and rounded to the dtype as at::sigmoid / at::silu round it (for
// 16-bit dtypes with the fast exponential and division: a few float32 ulp before that rounding).
// o [B, T, n, Dh] contiguous, gate [B, T, n Dh] with unit stride on its last axis (a column slice of a
// wider projection, say), gamma [n, Dh], y [B, T, Hy, Dh] contiguous; n <= 256, Dh <= 256. Other heads
// of y are left as they are.
enum class GateActivation { kNone = 0, kSigmoid = 1, kSilu = 2 };  // device_ops.cuh's gate_activation<ACT> numbering
void fusion_norm_forward_into(const at::Tensor& o, const at::Tensor& gate, GateActivation act, const at::Tensor& gamma,
                              double eps, at::Tensor& y, const std::vector<int64_t>& heads);

// chunk_output_f16 with fusion_norm_forward_into in its epilogue, for inference: each chunk's output o,
// rounded to y's dtype as chunk_output_f16 stores it, goes through the fusion norm straight into y
// (head h of the rule to y[b, t, heads[h]]), so o is never written or read back. The formulas and
// roundings are fusion_norm_forward_into's; only each row's sum of squares is added in another order
// (its float32 sum may differ in the last place, and then a rounded output by a few ulp, rarely).
// gate [B, T, H Dv] with unit stride on its last axis and evenly spaced rows 16 bytes apart, gamma [H, Dv]
// contiguous, y [B, T, Hy, Dv] contiguous, all of one 16-bit dtype and 16-byte aligned; H <= 256, Dv 64 or
// 128 (chunk_output_fusion_supported; chunk_output_fusion_fits for the tensors).
// A head's two 64-column halves of a chunk run in one cluster, so it needs compute capability 9.0.
struct OutputFusion {
  at::Tensor gate, gamma;
  GateActivation act = GateActivation::kNone;
  double eps = 1e-6;
  std::vector<int64_t> heads;
};
bool chunk_output_fusion_supported(int64_t H, int64_t Dv, at::ScalarType dtype);
bool chunk_output_fusion_fits(const OutputFusion& fusion, const at::Tensor& y);
void chunk_output_f16_fused(const ChunkFactors& f, const at::Tensor& S16, const at::Tensor& S_inv, const at::Tensor& M16,
                            const at::Tensor& M_inv, const ChunkGrid& grid, int64_t B, int64_t T, const OutputFusion& fusion,
                            at::Tensor& y);
struct FusionNormGrads {
  at::Tensor d_o, d_gate;  // like o
  at::Tensor d_gamma;      // [n, Dh] float32 (summed over rows)
};
// Gradients of sum(dy * y) for the forward above, in float32 inside (the roundings are treated as
// identities, as autograd of the op sequence does for the casts). dy like o.
FusionNormGrads fusion_norm_backward(const at::Tensor& dy, const at::Tensor& o, const at::Tensor& gate,
                                     const at::Tensor& gamma, double eps);

}  // namespace hh::kernels
