// The dtype a model loads in (model::resolve_dtype): the checkpoint's, a named one, or "auto", which
// takes float32 on the CPU for a 16-bit checkpoint and keeps the stored dtype everywhere else; and the
// device it loads on (model::parse_device).
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "core/model/transformer.h"
#include "support/test_support.h"

namespace hh::model {
namespace {

TEST(Dtype, AutoTakesFloat32OnTheCpuForA16BitCheckpointOnly) {
  const at::Device cpu(at::kCPU), gpu(at::kCUDA, 0);
  EXPECT_EQ(resolve_dtype("auto", cpu, at::kBFloat16), at::kFloat);
  EXPECT_EQ(resolve_dtype("auto", cpu, at::kHalf), at::kFloat);
  EXPECT_EQ(resolve_dtype("auto", cpu, at::kFloat), at::kFloat);
  EXPECT_EQ(resolve_dtype("auto", cpu, at::kDouble), at::kDouble);
  EXPECT_EQ(resolve_dtype("auto", gpu, at::kBFloat16), at::kBFloat16);
  EXPECT_EQ(resolve_dtype("auto", gpu, at::kHalf), at::kHalf);
}

TEST(Dtype, CanonicalNamesCoverTheLongForms) {
  EXPECT_EQ(canonical_dtype("float32"), "f32");
  EXPECT_EQ(canonical_dtype("float"), "f32");
  EXPECT_EQ(canonical_dtype("bfloat16"), "bf16");
  EXPECT_EQ(canonical_dtype("half"), "f16");
  EXPECT_EQ(canonical_dtype("fp64"), "f64");
  EXPECT_EQ(canonical_dtype("auto"), "");  // not a dtype itself: resolve_dtype's word
  EXPECT_EQ(canonical_dtype("BF16"), "");
  // The options resolve_dtype takes: "" and "auto" besides the names.
  for (const char* n : {"", "auto", "f32", "bfloat16", "double"}) EXPECT_TRUE(is_dtype_option(n)) << n;
  for (const char* n : {"fp8", "Auto", "BF16", "int8"}) {
    EXPECT_FALSE(is_dtype_option(n)) << n;
    EXPECT_THROW(check_dtype(n), hh::Error) << n;
  }
  EXPECT_NO_THROW(check_dtype("auto"));
  for (const char* n : {"f32", "fp32", "float32", "float", "bf16", "bfloat16", "f16", "fp16", "float16", "half", "f64",
                        "fp64", "float64", "double"})
    EXPECT_NO_THROW(parse_dtype(n)) << n;
}

TEST(Dtype, EmptyKeepsTheCheckpointsAndANameIsTaken) {
  const at::Device cpu(at::kCPU), gpu(at::kCUDA, 0);
  EXPECT_EQ(resolve_dtype("", cpu, at::kBFloat16), at::kBFloat16);
  EXPECT_EQ(resolve_dtype("", gpu, at::kHalf), at::kHalf);
  EXPECT_EQ(resolve_dtype("bf16", cpu, at::kFloat), at::kBFloat16);
  EXPECT_EQ(resolve_dtype("float32", gpu, at::kBFloat16), at::kFloat);
  EXPECT_MENTIONS(test::error_of([&] { resolve_dtype("fp8", cpu, at::kFloat); }), "'fp8'");
  EXPECT_NO_THROW(check_dtype(""));
  EXPECT_NO_THROW(check_dtype("auto"));
  EXPECT_NO_THROW(check_dtype("f16"));
  EXPECT_MENTIONS(test::error_of([&] { check_dtype("Auto"); }), "unknown dtype 'Auto'");
}

// parse_device: a device this build or machine lacks is refused by name before any tensor is made there
// (LibTorch itself fails later, at the first allocation, with a dispatcher table). cuda:N past the
// machine's count is refused on every machine: none has 1000 devices.
TEST(Device, ParsesCpuAndRefusesWhatTheMachineLacksByName) {
  EXPECT_TRUE(parse_device("cpu").is_cpu());
  EXPECT_MENTIONS(test::error_of([] { parse_device("gpu"); }), "unknown device 'gpu'");
  EXPECT_MENTIONS(test::error_of([] { parse_device("meta"); }), "only cpu and cuda");
  const std::string far = test::error_of([] { parse_device("cuda:1000"); });
  EXPECT_MENTIONS(far, "device 'cuda:1000'");
  if (torch::cuda::device_count() == 0) {
    EXPECT_MENTIONS(test::error_of([] { parse_device("cuda"); }), "no CUDA device");
  } else {
    EXPECT_TRUE(parse_device("cuda").is_cuda());
    EXPECT_MENTIONS(far, "this machine has");
  }
}

}  // namespace
}  // namespace hh::model
