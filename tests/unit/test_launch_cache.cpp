// The table of dynamic shared memory each kernel was allowed on each device (kernels/launch_cache.h):
// a launch sets the attribute only where that kernel and device were not given exactly its bytes.
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "kernels/launch_cache.h"

namespace {

using hh::kernels::SmemAllowance;

// Two distinct addresses in place of two kernels' (empty functions could be folded into one).
const int kernel_a = 0, kernel_b = 0;
const void* key(const int& k) { return &k; }

TEST(SmemAllowance, AKernelNeedsItsBytesOnceADevice) {
  SmemAllowance t;
  EXPECT_TRUE(t.needs(key(kernel_a), 0, 1024));
  t.given(key(kernel_a), 0, 1024);
  EXPECT_FALSE(t.needs(key(kernel_a), 0, 1024));
  EXPECT_FALSE(t.needs(key(kernel_a), 0, 1024));  // asking does not change it
  EXPECT_TRUE(t.needs(key(kernel_a), 1, 1024)) << "another device has its own attribute";
  EXPECT_TRUE(t.needs(key(kernel_b), 0, 1024)) << "another kernel has its own attribute";
  EXPECT_EQ(t.size(), 1u);
}

TEST(SmemAllowance, OtherBytesAreSetAgainAndReplaceTheOldOnes) {
  SmemAllowance t;
  t.given(key(kernel_a), 0, 1024);
  // The attribute is set to exactly the launch's bytes, as it was on every launch: fewer bytes too.
  EXPECT_TRUE(t.needs(key(kernel_a), 0, 2048));
  EXPECT_TRUE(t.needs(key(kernel_a), 0, 512));
  t.given(key(kernel_a), 0, 2048);
  EXPECT_FALSE(t.needs(key(kernel_a), 0, 2048));
  EXPECT_TRUE(t.needs(key(kernel_a), 0, 1024));
  EXPECT_EQ(t.size(), 1u);
}

TEST(SmemAllowance, ASetNeverRecordedIsAskedForAgain) {
  SmemAllowance t;  // a failed cudaFuncSetAttribute throws before given(): the next launch tries again
  EXPECT_TRUE(t.needs(key(kernel_a), 0, 4096));
  EXPECT_TRUE(t.needs(key(kernel_a), 0, 4096));
  EXPECT_EQ(t.size(), 0u);
}

TEST(SmemAllowance, ThreadsLaunchingAtOnceLoseNoEntry) {
  SmemAllowance t;
  constexpr int kThreads = 8, kDevices = 64;
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&t, i] {
      for (int d = 0; d < kDevices; ++d) {
        const void* k = i % 2 ? key(kernel_a) : key(kernel_b);
        const std::size_t bytes = 1000 + static_cast<std::size_t>(d);
        if (t.needs(k, d, bytes)) t.given(k, d, bytes);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(t.size(), 2u * kDevices);
  for (int d = 0; d < kDevices; ++d) {
    EXPECT_FALSE(t.needs(key(kernel_a), d, 1000 + static_cast<std::size_t>(d)));
    EXPECT_FALSE(t.needs(key(kernel_b), d, 1000 + static_cast<std::size_t>(d)));
  }
}

}  // namespace
