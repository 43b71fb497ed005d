// kernels/device_table: a table is uploaded once for its values and device, and a kept one read from
// another stream waits for its copy.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#ifdef HH_HAVE_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/device_table.h"
#endif

namespace {

#ifdef HH_HAVE_KERNELS
using hh::kernels::device_table;
using hh::kernels::device_table_uploads;

// Values no other test asks for: a seed's own run of large, distinct numbers.
std::vector<int64_t> values_of(int64_t seed, int64_t n = 7) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(1000003 * seed + 7919 * i + 1);
  return v;
}

std::vector<int64_t> read_back(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU);
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

TEST(DeviceTable, UploadsOnceForEachValuesAndDevice) {
  ASSERT_TRUE(torch::cuda::is_available());
  const at::Device dev(at::kCUDA, 0);
  const auto a = values_of(11), b = values_of(12);
  const int64_t before = device_table_uploads();
  const at::Tensor ta = device_table(a, dev);
  EXPECT_EQ(device_table_uploads(), before + 1);
  EXPECT_TRUE(ta.is_cuda());
  EXPECT_EQ(ta.scalar_type(), at::kLong);
  EXPECT_EQ(read_back(ta), a);
  const at::Tensor again = device_table(a, dev);
  EXPECT_EQ(device_table_uploads(), before + 1) << "the same values again: no upload";
  EXPECT_EQ(again.data_ptr(), ta.data_ptr());
  const at::Tensor tb = device_table(b, dev);
  EXPECT_EQ(device_table_uploads(), before + 2);
  EXPECT_NE(tb.data_ptr(), ta.data_ptr());
  EXPECT_EQ(read_back(tb), b);
  // A prefix of b is other values.
  const std::vector<int64_t> prefix(b.begin(), b.end() - 1);
  EXPECT_EQ(read_back(device_table(prefix, dev)), prefix);
  EXPECT_EQ(device_table_uploads(), before + 3);
}

TEST(DeviceTable, KeepsTheMostRecentlyUsed) {
  ASSERT_TRUE(torch::cuda::is_available());
  const at::Device dev(at::kCUDA, 0);
  const auto first = values_of(21), second = values_of(22);
  (void)device_table(first, dev);
  (void)device_table(second, dev);
  // kKeptTables - 1 others, with `first` used again half way: it stays, `second` goes.
  for (size_t i = 0; i + 1 < hh::kernels::kKeptTables; ++i) {
    if (i == hh::kernels::kKeptTables / 2) (void)device_table(first, dev);
    (void)device_table(values_of(1000 + static_cast<int64_t>(i)), dev);
  }
  const int64_t before = device_table_uploads();
  EXPECT_EQ(read_back(device_table(first, dev)), first);
  EXPECT_EQ(device_table_uploads(), before) << "used recently: still kept";
  EXPECT_EQ(read_back(device_table(second, dev)), second);
  EXPECT_EQ(device_table_uploads(), before + 1) << "the least recently used: uploaded again";
}

TEST(DeviceTable, AnotherStreamWaitsForTheCopy) {
  ASSERT_TRUE(torch::cuda::is_available());
  const at::Device dev(at::kCUDA, 0);
  const c10::cuda::CUDAGuard guard(dev);
  const auto v = values_of(31, 4096);
  const c10::cuda::CUDAStream s1 = c10::cuda::getStreamFromPool(false, 0), s2 = c10::cuda::getStreamFromPool(false, 0);
  ASSERT_NE(s1, s2);
  at::Tensor kept, seen;
  {
    const c10::cuda::CUDAStreamGuard on1(s1);
    at::cuda::sleep(200'000'000);  // ~0.1 s of the device on s1, so the copy queued behind it lands late
    kept = device_table(v, dev);
  }
  {
    const c10::cuda::CUDAStreamGuard on2(s2);
    const int64_t before = device_table_uploads();
    const at::Tensor t = device_table(v, dev);
    EXPECT_EQ(device_table_uploads(), before);
    EXPECT_EQ(t.data_ptr(), kept.data_ptr());
    seen = t.clone();  // on s2: must wait for s1's copy
  }
  torch::cuda::synchronize();
  EXPECT_EQ(read_back(seen), v);
}

TEST(DeviceTable, CpuTablesForTheCpu) {
  const auto v = values_of(41);
  const at::Tensor t = device_table(v, at::Device(at::kCPU));
  EXPECT_FALSE(t.is_cuda());
  EXPECT_EQ(read_back(t), v);
}
#endif

}  // namespace
