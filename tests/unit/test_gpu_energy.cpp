// util::GpuEnergy on any machine: without NVIDIA's management library (or without the device asked
// for) it says why and reads nothing; with it, the counter reads and never goes back.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/util/gpu_energy.h"

TEST(GpuEnergy, ReadsTheCounterOrSaysWhyNot) {
  const hh::util::GpuEnergy e(0);
  if (!e.available()) {
    EXPECT_FALSE(e.why_unavailable().empty());
    EXPECT_FALSE(e.millijoules().has_value());
    GTEST_SKIP() << "no energy counter here: " << e.why_unavailable();
  }
  EXPECT_TRUE(e.why_unavailable().empty());
  const auto a = e.millijoules();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // past the device's update interval
  const auto b = e.millijoules();
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_GT(*a, 0u) << "drawn since the driver loaded";
  EXPECT_GE(*b, *a) << "the counter only grows";
}

TEST(GpuEnergy, ADeviceThatIsNotThereIsUnavailable) {
  const hh::util::GpuEnergy e(4096);  // more GPUs than a machine has
  EXPECT_FALSE(e.available());
  EXPECT_FALSE(e.millijoules().has_value());
  EXPECT_FALSE(e.why_unavailable().empty());
}
