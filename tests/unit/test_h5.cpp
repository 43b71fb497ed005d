// HDF5 wrapper: round trips of tensors, strings and attributes, atomic create/commit, errors that
// name file and dataset, and (when h5py is importable) that h5py reads what we write.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cstdlib>
#include <iterator>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/io/h5.h"
#include "core/util/error.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
using hh::io::H5File;

using hh::test::error_of;

std::vector<std::string> entries_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(H5File, RoundTripTensorsStringsAttributes) {
  const auto dir = hh::test::scratch_dir("h5");
  const auto path = dir / "run.h5";
  torch::manual_seed(0);
  const at::Tensor logits = torch::randn({7, 11});                              // [T, V]
  const at::Tensor tokens = torch::arange(0, 7, torch::kLong);                  // [T]
  const at::Tensor f64 = torch::randn({2, 3}, torch::kDouble);
  const at::Tensor i32 = torch::arange(-5, 5, torch::kInt).reshape({2, 5});
  const at::Tensor bf16 = torch::randn({4, 2}).to(torch::kBFloat16);
  const at::Tensor half = torch::randn({3}).to(torch::kHalf);
  const at::Tensor u8 = torch::arange(0, 200, torch::kByte);
  const at::Tensor flags = torch::tensor({true, false, true});
  const at::Tensor scalar = torch::tensor(2.5f);
  const at::Tensor empty = torch::zeros({0, 4});
  const at::Tensor strided = torch::arange(0, 12, torch::kFloat).reshape({3, 4}).t();  // non-contiguous
  const std::vector<std::string> tasks = {"niah_single", "h\xc3\xa9llo", "", "\xe6\x97\xa5\xe6\x9c\xac"};

  {
    auto f = H5File::create(path);
    f.write("/logits", logits, {"pos", "vocab"});
    f.write("tokens", tokens, {"pos"});  // relative paths start at the root
    f.write("/deep/group/chain/f64", f64);
    f.write("/i32", i32, {"", "col"});
    f.write("/bf16", bf16);
    f.write("/half", half);
    f.write("/u8", u8);
    f.write("/flags", flags);
    f.write("/scalar", scalar);
    f.write("/empty", empty);
    f.write("/strided", strided);
    f.write_strings("/examples/task", tasks);
    f.write_strings("/examples/none", {});
    f.set_attr("/", "format", "hydrahead-analysis");
    f.set_attr("/", "format_version", 1);
    f.set_attr("/", "eps", 1e-6);
    f.set_attr("/logits", "note", std::string("replaced"));
    f.set_attr("/logits", "note", std::string("final"));  // setting replaces
    f.create_group("/activation/noising");
    EXPECT_FALSE(fs::exists(path)) << "nothing at the final path before commit()";
    f.commit();
    EXPECT_FALSE(f.is_open());
  }
  EXPECT_EQ(entries_in(dir), std::vector<std::string>{"run.h5"});

  const auto f = H5File::open_read(path);
  EXPECT_TRUE(torch::equal(f.read("/logits"), logits));
  EXPECT_EQ(f.read("/tokens").scalar_type(), torch::kLong);
  EXPECT_TRUE(torch::equal(f.read("/tokens"), tokens));
  EXPECT_TRUE(torch::equal(f.read("/deep/group/chain/f64"), f64));
  EXPECT_TRUE(torch::equal(f.read("/i32"), i32));
  EXPECT_EQ(f.read("/bf16").scalar_type(), torch::kFloat);  // 16-bit floats are widened
  EXPECT_TRUE(torch::equal(f.read("/bf16"), bf16.to(torch::kFloat)));
  EXPECT_TRUE(torch::equal(f.read("/half"), half.to(torch::kFloat)));
  EXPECT_TRUE(torch::equal(f.read("/u8"), u8));
  EXPECT_TRUE(torch::equal(f.read("/flags"), flags.to(torch::kByte)));
  EXPECT_EQ(f.read("/scalar").dim(), 0);
  EXPECT_FLOAT_EQ(f.read("/scalar").item<float>(), 2.5f);
  EXPECT_EQ(f.read("/empty").sizes(), empty.sizes());
  EXPECT_TRUE(torch::equal(f.read("/strided"), strided));
  EXPECT_EQ(f.shape("/logits"), (std::vector<int64_t>{7, 11}));

  EXPECT_EQ(f.dim_labels("/logits"), (std::vector<std::string>{"pos", "vocab"}));
  EXPECT_EQ(f.dim_labels("/i32"), (std::vector<std::string>{"", "col"}));
  EXPECT_EQ(f.dim_labels("/u8"), (std::vector<std::string>{""}));

  EXPECT_EQ(f.read_strings("/examples/task"), tasks);
  EXPECT_TRUE(f.read_strings("/examples/none").empty());
  EXPECT_EQ(f.attr_string("/", "format"), "hydrahead-analysis");
  EXPECT_EQ(f.attr_int("/", "format_version"), 1);
  EXPECT_DOUBLE_EQ(f.attr_double("/", "eps"), 1e-6);
  EXPECT_DOUBLE_EQ(f.attr_double("/", "format_version"), 1.0);
  EXPECT_EQ(f.attr_string("/logits", "note"), "final");
  EXPECT_TRUE(f.has_attr("/", "format"));
  EXPECT_FALSE(f.has_attr("/", "absent"));
  EXPECT_FALSE(f.has_attr("/nope", "format"));

  EXPECT_TRUE(f.exists("/deep/group/chain"));
  EXPECT_TRUE(f.exists("/activation/noising"));
  EXPECT_FALSE(f.exists("/deep/nothing/here"));
  EXPECT_FALSE(f.exists("/missing"));
  EXPECT_EQ(f.list("/examples"), (std::vector<std::string>{"none", "task"}));
}

TEST(H5File, LargeDatasetsAreCompressed) {
  const auto path = hh::test::scratch_dir("h5") / "big.h5";
  const at::Tensor zeros = torch::zeros({512, 1024});  // 2 MiB of f32
  {
    auto f = H5File::create(path);
    f.write("/big", zeros, {"example", "feature"});
    f.commit();
  }
  EXPECT_LT(fs::file_size(path), 256u * 1024u);
  EXPECT_TRUE(torch::equal(H5File::open_read(path).read("/big"), zeros));
}

TEST(H5File, RewritingADatasetReplacesIt) {
  const auto path = hh::test::scratch_dir("h5") / "r.h5";
  auto f = H5File::create(path);
  f.write("/x", torch::zeros({3}));
  f.write("/x", torch::ones({2, 2}, torch::kLong));
  EXPECT_TRUE(torch::equal(f.read("/x"), torch::ones({2, 2}, torch::kLong)));
  f.commit();
}

TEST(H5File, DroppedWithoutCommitLeavesNothing) {
  const auto dir = hh::test::scratch_dir("h5");
  {
    auto f = H5File::create(dir / "out.h5");
    f.write("/x", torch::ones({100}));
  }
  EXPECT_TRUE(entries_in(dir).empty());
  {
    auto f = H5File::create(dir / "out.h5");
    auto moved = std::move(f);  // ownership moves with the object
    moved.write("/x", torch::ones({4}));
    moved.commit();
  }
  EXPECT_EQ(entries_in(dir), std::vector<std::string>{"out.h5"});
}

TEST(H5File, OpenRwChangesInPlace) {
  const auto path = hh::test::scratch_dir("h5") / "rw.h5";
  {
    auto f = H5File::create(path);
    f.write("/a", torch::ones({2}));
    f.commit();
  }
  {
    auto f = H5File::open_rw(path);
    f.write("/b", torch::zeros({3}));
    f.set_attr("/a", "unit", "nats");
    f.commit();
  }
  const auto f = H5File::open_read(path);
  EXPECT_EQ(f.list(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(f.attr_string("/a", "unit"), "nats");
}

TEST(H5File, ErrorsNameFileAndDataset) {
  const auto dir = hh::test::scratch_dir("h5");
  EXPECT_MENTIONS(error_of([&] { H5File::open_read(dir / "absent.h5"); }), "absent.h5");
  std::ofstream(dir / "not.h5") << "plain text, not HDF5";
  EXPECT_MENTIONS(error_of([&] { H5File::open_read(dir / "not.h5"); }), "not.h5");

  const auto path = dir / "e.h5";
  {
    auto f = H5File::create(path);
    f.write("/x", torch::zeros({2, 2}));
    f.write_strings("/s", {"a"});
    auto msg = error_of([&] { f.write("/y", torch::zeros({2, 2}), {"only-one"}); });
    EXPECT_MENTIONS(msg, "e.h5");
    EXPECT_MENTIONS(msg, "'/y'");
    msg = error_of([&] { f.write("/c", torch::zeros({2}, torch::kComplexFloat)); });
    EXPECT_MENTIONS(msg, "'/c'");
    msg = error_of([&] { f.write_strings("/nul", {std::string("a\0b", 3)}); });
    EXPECT_MENTIONS(msg, "'/nul'");
    f.commit();
  }
  auto f = H5File::open_read(path);
  auto msg = error_of([&] { f.read("/missing/dataset"); });
  EXPECT_MENTIONS(msg, "e.h5");
  EXPECT_MENTIONS(msg, "'/missing/dataset'");
  EXPECT_MENTIONS(error_of([&] { f.read("/s"); }), "'/s'");
  EXPECT_MENTIONS(error_of([&] { f.read_strings("/x"); }), "'/x'");
  msg = error_of([&] { f.attr_string("/x", "absent"); });
  EXPECT_MENTIONS(msg, "e.h5");
  EXPECT_MENTIONS(msg, "'absent'");
  msg = error_of([&] { f.write("/z", torch::zeros({1})); });
  EXPECT_MENTIONS(msg, "read-only");
  f.close();
  EXPECT_MENTIONS(error_of([&] { f.read("/x"); }), "closed");
}

// The first interpreter on this machine that can import h5py, or "" when none can.
std::string python_with_h5py() {
  for (const char* py : {"python3", "/usr/bin/python3"}) {
    const std::string cmd = std::string(py) + " -c 'import h5py' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return {};
}

constexpr const char* kH5pyCheck = R"PY(
import sys
import h5py
import numpy as np

def text(v):
    return v.decode("utf-8") if isinstance(v, bytes) else v

with h5py.File(sys.argv[1], "r") as f:
    assert text(f.attrs["format"]) == "hydrahead-analysis", f.attrs["format"]
    assert int(f.attrs["format_version"]) == 1
    assert abs(float(f.attrs["eps"]) - 1e-6) < 1e-18
    logits = f["/logits"]
    assert logits.dtype == np.float32 and logits.shape == (3, 5), (logits.dtype, logits.shape)
    assert np.array_equal(logits[...], np.arange(15, dtype=np.float32).reshape(3, 5))
    assert [d.label for d in logits.dims] == ["pos", "vocab"], [d.label for d in logits.dims]
    tokens = f["/tokens"]
    assert tokens.dtype == np.int64 and list(tokens[...]) == [5, 6, 7]
    assert f["/i32"].dtype == np.int32
    assert f["/f64"].dtype == np.float64
    big = f["/activation/noising/metric_patched"]
    assert big.compression == "gzip" and big.shuffle and big.chunks is not None
    assert big.shape == (32, 28, 16) and float(big[...].sum()) == 32 * 28 * 16
    tasks = [text(t) for t in f["/examples/task"][...]]
    assert tasks == ["niah", "h\u00e9llo", ""], tasks
    assert h5py.check_string_dtype(f["/examples/task"].dtype).encoding == "utf-8"
print("h5py-ok")
)PY";

TEST(H5File, H5pyReadsWhatWeWrite) {
  const std::string python = python_with_h5py();
  if (python.empty()) GTEST_SKIP() << "h5py is not importable";
  const auto dir = hh::test::scratch_dir("h5");
  const auto path = dir / "for_h5py.h5";
  {
    auto f = H5File::create(path);
    f.set_attr("/", "format", "hydrahead-analysis");
    f.set_attr("/", "format_version", 1);
    f.set_attr("/", "eps", 1e-6);
    f.write("/logits", torch::arange(0, 15, torch::kFloat).reshape({3, 5}), {"pos", "vocab"});
    f.write("/tokens", torch::tensor({5, 6, 7}, torch::kLong), {"pos"});
    f.write("/i32", torch::zeros({2}, torch::kInt));
    f.write("/f64", torch::zeros({2}, torch::kDouble));
    f.write("/activation/noising/metric_patched", torch::ones({32, 28, 16}), {"example", "layer", "head"});  // 56 KiB: compressed
    f.write_strings("/examples/task", {"niah", "h\xc3\xa9llo", ""});
    f.commit();
  }
  std::ofstream(dir / "check.py") << kH5pyCheck;
  const std::string cmd = python + " " + (dir / "check.py").string() + " " + path.string() + " > " +
                          (dir / "check.log").string() + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::ifstream log(dir / "check.log");
  const std::string output((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_EQ(rc, 0) << output;
  EXPECT_NE(output.find("h5py-ok"), std::string::npos) << output;
}

// ---- live files (SWMR) ------------------------------------------------------------------------------

at::Tensor f64s(std::vector<double> v) { return at::tensor(v, at::TensorOptions().dtype(at::kDouble)); }

TEST(H5Live, AppendWriteAtTruncateAndReopen) {
  const fs::path p = hh::test::scratch_dir("h5_live") / "run.h5";
  {
    auto f = hh::io::H5File::create_live(p);
    f.set_attr("/", "format", "test");
    f.create_series("/train/loss", at::kDouble, 4);
    f.create_series("/train/step", at::kLong);
    f.write("/marks", at::full({3}, int64_t{-1}, at::TensorOptions().dtype(at::kLong)));
    EXPECT_MENTIONS(hh::test::error_of([&] { f.create_series("/train/loss", at::kDouble); }), "already exists");
    EXPECT_MENTIONS(hh::test::error_of([&] { f.create_series("/x", at::kBool); }), "/x");
    f.start_swmr_write();
    EXPECT_TRUE(f.swmr_writing());
    f.append("/train/loss", f64s({1.5, 2.5}));
    f.append("/train/loss", f64s({3.5, 4.5, 5.5, 6.5, 7.5}));   // crosses chunk boundaries
    f.append("/train/step", at::arange(1, 8, at::TensorOptions().dtype(at::kLong)));
    f.write_at("/marks", 1, at::full({1}, int64_t{7}, at::TensorOptions().dtype(at::kLong)));
    std::string msg = hh::test::error_of([&] { f.truncate("/train/loss", 2); });
    EXPECT_MENTIONS(msg, "SWMR");
    msg = hh::test::error_of([&] { f.write_at("/marks", 3, at::zeros({1}, at::kLong)); });
    EXPECT_MENTIONS(msg, "/marks");
    EXPECT_MENTIONS(msg, "outside its 3 rows");
    msg = hh::test::error_of([&] { f.create_series("/late", at::kDouble); });
    EXPECT_MENTIONS(msg, "SWMR");
    f.commit();
  }
  {
    auto f = hh::io::H5File::open_read(p);
    EXPECT_TRUE(at::equal(f.read("/train/loss"), f64s({1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5})));
    EXPECT_TRUE(at::equal(f.read("/marks"), at::tensor({-1, 7, -1}, at::TensorOptions().dtype(at::kLong))));
  }
  {
    auto f = hh::io::H5File::open_live(p);   // a resumed writer drops the rows after its checkpoint
    f.truncate("/train/loss", 3);
    EXPECT_MENTIONS(hh::test::error_of([&] { f.truncate("/train/loss", 9); }), "cannot keep 9 of its 3 rows");
    f.start_swmr_write();
    f.append("/train/loss", f64s({9.0}));
    f.commit();
  }
  auto f = hh::io::H5File::open_read(p);
  EXPECT_TRUE(at::equal(f.read("/train/loss"), f64s({1.5, 2.5, 3.5, 9.0})));
  EXPECT_EQ(f.read("/train/step").size(0), 7);
}

// The writer half of FollowerSeesRowsWhileTheWriterRuns, run in a child process (skipped otherwise).
TEST(H5Live, WriterChild) {
  const char* path = std::getenv("HH_H5_LIVE_CHILD");
  if (path == nullptr) GTEST_SKIP() << "runs only as the child of FollowerSeesRowsWhileTheWriterRuns";
  auto f = hh::io::H5File::create_live(std::string(path) + ".part");
  f.create_series("/rows", at::kDouble);
  f.start_swmr_write();
  fs::rename(std::string(path) + ".part", path);   // the follower opens it once it is in SWMR mode
  for (int i = 0; i < 60; ++i) {
    f.append("/rows", f64s({static_cast<double>(i)}));
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  f.commit();
}

TEST(H5Live, FollowerSeesRowsWhileTheWriterRuns) {
  const fs::path p = hh::test::scratch_dir("h5_follow") / "live.h5";
  const std::string filter = "--gtest_filter=H5Live.WriterChild";
  const std::string env = "HH_H5_LIVE_CHILD=" + p.string();
  char exe[4096] = {};
  ASSERT_GT(::readlink("/proc/self/exe", exe, sizeof exe - 1), 0);
  char* argv[] = {exe, const_cast<char*>(filter.c_str()), nullptr};
  char* envp[] = {const_cast<char*>(env.c_str()), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(::posix_spawn(&pid, exe, nullptr, nullptr, argv, envp), 0);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(p) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_TRUE(fs::exists(p));
  auto f = hh::io::H5File::open_follow(p);
  std::set<int64_t> sizes_seen;
  int64_t rows = 0;
  while (rows < 60 && std::chrono::steady_clock::now() < deadline) {
    f.refresh("/rows");
    const at::Tensor t = f.read("/rows");
    rows = t.size(0);
    // Every row the follower sees is complete and in order.
    for (int64_t i = 0; i < rows; ++i) ASSERT_EQ(t[i].item<double>(), static_cast<double>(i));
    if (rows > 0 && rows < 60) sizes_seen.insert(rows);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(rows, 60);
  EXPECT_GE(sizes_seen.size(), 3u) << "the follower saw the dataset grow while it was written";
}

// The reader half of ReopeningForWritingWhileReadersPoll, run in a child process (skipped otherwise):
// opens the file, reads it and closes it, over and over, until the stop file appears. HH_H5_READER
// "follow" follows it (SWMR read, as the workbench's runs view does every second), "read" opens it
// read-only, as another program might, holding HDF5's file lock while it has the file open.
TEST(H5Live, ReaderChild) {
  const char* path = std::getenv("HH_H5_READER_CHILD");
  if (path == nullptr) GTEST_SKIP() << "runs only as the child of ReopeningForWritingWhileReadersPoll";
  const bool follow = std::string(std::getenv("HH_H5_READER") ? std::getenv("HH_H5_READER") : "") == "follow";
  const fs::path stop = std::string(path) + ".stop";
  std::ofstream(std::string(path) + ".ready") << "reading\n";  // the parent starts reopening now
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!fs::exists(stop) && std::chrono::steady_clock::now() < deadline) {
    try {
      auto f = follow ? hh::io::H5File::open_follow(path) : hh::io::H5File::open_read(path);
      if (follow) f.refresh("/rows");
      (void)f.read("/rows");
    } catch (const std::exception&) {
      // the writer holds the file between its reopening and SWMR mode: the next round reads it
    }
  }
}

// A resumed job reopens its run.h5 for writing while the workbench may be following it, or another
// program reading it. HDF5 locks the file while a process opens it, and a writer's reopening (or its
// start of SWMR writing) used to fail outright when a reader held that lock at that moment. Fifty
// reopenings, each appending a row, against a child process that reads the file without pause: as a
// follower (which takes no lock) and as a plain reader (whose lock the writer waits out).
TEST(H5Live, ReopeningForWritingWhileReadersPoll) {
  for (const std::string reader : {"follow", "read"}) {
    const fs::path p = hh::test::scratch_dir("h5_reopen_" + reader) / "live.h5";
    {
      auto f = hh::io::H5File::create_live(p);
      f.create_series("/rows", at::kDouble);
      f.start_swmr_write();
      f.commit();
    }
    const fs::path stop = p.string() + ".stop", ready = p.string() + ".ready";
    const std::string filter = "--gtest_filter=H5Live.ReaderChild";
    const std::string env = "HH_H5_READER_CHILD=" + p.string(), mode = "HH_H5_READER=" + reader;
    char exe[4096] = {};
    ASSERT_GT(::readlink("/proc/self/exe", exe, sizeof exe - 1), 0);
    char* argv[] = {exe, const_cast<char*>(filter.c_str()), nullptr};
    char* envp[] = {const_cast<char*>(env.c_str()), const_cast<char*>(mode.c_str()), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(::posix_spawn(&pid, exe, nullptr, nullptr, argv, envp), 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!fs::exists(ready) && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(fs::exists(ready)) << reader << ": the reader did not start";

    std::vector<std::string> failures;
    for (int i = 0; i < 50; ++i) {
      try {
        auto f = hh::io::H5File::open_live(p);
        f.start_swmr_write();
        f.append("/rows", f64s({static_cast<double>(i)}));
        f.commit();
      } catch (const std::exception& e) {
        failures.push_back(e.what());
      }
    }
    std::ofstream(stop.string()) << "stop\n";
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << reader;
    EXPECT_TRUE(failures.empty()) << reader << ": " << failures.size() << " of 50 reopenings failed, the first: "
                                  << (failures.empty() ? std::string() : failures.front());
    EXPECT_EQ(hh::io::H5File::open_read(p).read("/rows").size(0), static_cast<int64_t>(50 - failures.size())) << reader;
  }
}

}  // namespace
