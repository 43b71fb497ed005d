// The task-plugin loader: each kind of bad library is refused with its file named while loading goes
// on, parameters resolve with defaults and checks, and generation goes through the tokenizer adapter.
// The plugins are tests/plugins/*.c, built into HH_TEST_PLUGIN_DIR.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>

#include "core/interp/calibration.h"
#include "core/interp/task_registry.h"
#include "core/model/tokenizer.h"
#include "core/util/error.h"
#include "support/test_support.h"
#include "test_paths.h"

namespace {

namespace fs = std::filesystem;
using hh::interp::CalibExample;
using hh::interp::ParamType;
using hh::interp::TaskRegistry;
using nlohmann::json;

fs::path plugin(const std::string& name) { return fs::path(HH_TEST_PLUGIN_DIR) / (name + ".so"); }

const hh::model::Tokenizer& tiny_tokenizer() {
  static const auto tok = hh::model::Tokenizer::load(hh::test::data_dir() / "tokenizer" / "tiny-tokenizer.json");
  return tok;
}

// The one diagnostic that names `file`; fails the test when there is none or more than one.
std::string diagnostic_for(const TaskRegistry& reg, const fs::path& file) {
  std::string found;
  int count = 0;
  for (const auto& d : reg.diagnostics())
    if (d.find(file.filename().string()) != std::string::npos) {
      found = d;
      ++count;
    }
  EXPECT_EQ(count, 1) << "diagnostics naming " << file;
  return found;
}

using hh::test::error_of;

// Sets an environment variable for one scope and restores the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value, 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(TaskRegistry, GoodPluginRegistersItsTwoTasks) {
  TaskRegistry reg;
  EXPECT_TRUE(reg.load_library(plugin("good")));
  EXPECT_TRUE(reg.diagnostics().empty());
  ASSERT_EQ(reg.tasks().size(), 2u);
  EXPECT_EQ(reg.tasks()[0].id, "test-copy");
  EXPECT_EQ(reg.tasks()[0].kind, "reasoning");
  EXPECT_EQ(reg.tasks()[1].id, "test-echo");
  EXPECT_EQ(reg.tasks()[1].kind, "retrieval");
  EXPECT_EQ(reg.tasks()[0].library, plugin("good"));

  const auto* copy = reg.find("test-copy");
  ASSERT_NE(copy, nullptr);
  ASSERT_EQ(copy->params.size(), 5u);
  const auto* length = copy->param("length");
  ASSERT_NE(length, nullptr);
  EXPECT_EQ(length->type, ParamType::Int);
  EXPECT_EQ(length->default_value, json(6));
  EXPECT_EQ(length->min, 2);
  EXPECT_EQ(length->max, 64);
  EXPECT_EQ(copy->param("depth")->type, ParamType::Float);
  EXPECT_EQ(copy->param("mode")->choices, (std::vector<std::string>{"last", "first"}));
  EXPECT_EQ(copy->param("mode")->default_value, json("last"));
  EXPECT_EQ(copy->param("with_text")->default_value, json(true));
  EXPECT_EQ(reg.find("nope"), nullptr);
}

TEST(TaskRegistry, WrongAbiVersionIsRefusedNamingFileAndVersion) {
  TaskRegistry reg;
  EXPECT_FALSE(reg.load_library(plugin("wrong_version")));
  const auto d = diagnostic_for(reg, plugin("wrong_version"));
  EXPECT_NE(d.find(plugin("wrong_version").string()), std::string::npos) << d;
  EXPECT_NE(d.find("hydrahead_plugin_v2"), std::string::npos) << d;
  EXPECT_NE(d.find("version 1"), std::string::npos) << d;
  EXPECT_TRUE(reg.tasks().empty());
}

TEST(TaskRegistry, MissingEntrySymbolIsRefused) {
  TaskRegistry reg;
  EXPECT_FALSE(reg.load_library(plugin("missing_symbol")));
  const auto d = diagnostic_for(reg, plugin("missing_symbol"));
  EXPECT_NE(d.find(plugin("missing_symbol").string()), std::string::npos) << d;
  EXPECT_NE(d.find("no entry point hydrahead_plugin_v1"), std::string::npos) << d;
}

TEST(TaskRegistry, FailingEntryIsRefusedWithWhatItLogged) {
  TaskRegistry reg;
  EXPECT_FALSE(reg.load_library(plugin("failing_entry")));
  const auto d = diagnostic_for(reg, plugin("failing_entry"));
  EXPECT_NE(d.find("returned 3"), std::string::npos) << d;
  EXPECT_NE(d.find("haystack.txt not found"), std::string::npos) << d;
}

TEST(TaskRegistry, DuplicateIdRefusesTheWholeLibrary) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  EXPECT_FALSE(reg.load_library(plugin("duplicate")));
  const auto d = diagnostic_for(reg, plugin("duplicate"));
  EXPECT_NE(d.find(plugin("duplicate").string() + ": refused"), std::string::npos) << d;
  EXPECT_NE(d.find("'test-copy'"), std::string::npos) << d;
  EXPECT_NE(d.find(plugin("good").string()), std::string::npos) << "names the first owner: " << d;
  // What the refused library registered before the duplicate is gone too.
  EXPECT_EQ(reg.find("test-dup-extra"), nullptr);
  EXPECT_EQ(reg.tasks().size(), 2u);
  EXPECT_EQ(reg.find("test-copy")->library, plugin("good"));
}

TEST(TaskRegistry, MalformedRegistrationsAreRefusedAsAWhole) {
  TaskRegistry reg;
  EXPECT_FALSE(reg.load_library(plugin("malformed")));
  const auto d = diagnostic_for(reg, plugin("malformed"));
  EXPECT_NE(d.find("'banana'"), std::string::npos) << d;
  EXPECT_NE(d.find("parameter 'length': default 5 is outside [10, 20]"), std::string::npos) << d;
  EXPECT_TRUE(reg.tasks().empty()) << "the valid task of a refused library is dropped too";
}

TEST(TaskRegistry, FileThatIsNotASharedLibraryIsRefused) {
  const auto dir = hh::test::scratch_dir("registry");
  const auto bogus = dir / "bogus.so";
  std::ofstream(bogus) << "not an ELF file\n";
  TaskRegistry reg;
  EXPECT_FALSE(reg.load_library(bogus));
  const auto d = diagnostic_for(reg, bogus);
  EXPECT_NE(d.find("cannot load"), std::string::npos) << d;
}

TEST(TaskRegistry, LoadDirRefusesBadLibrariesAndLoadsTheRest) {
  TaskRegistry reg;
  reg.load_dir(HH_TEST_PLUGIN_DIR);
  // File-name order: bad_example, duplicate, failing_entry, good, malformed, missing_symbol,
  // wrong_version. duplicate.so comes before good.so, so it keeps "test-copy" and good.so is refused.
  for (const char* refused : {"failing_entry", "good", "malformed", "missing_symbol", "wrong_version"})
    EXPECT_NE(diagnostic_for(reg, plugin(refused)).find(plugin(refused).string()), std::string::npos) << refused;
  EXPECT_EQ(reg.diagnostics().size(), 5u);
  EXPECT_NE(diagnostic_for(reg, plugin("good"))
                .find("task id 'test-copy' is already registered by " + plugin("duplicate").string()),
            std::string::npos);
  for (const char* id : {"test-bad-json", "test-bad-lengths", "test-out-of-range", "test-fails", "test-dup-extra"})
    EXPECT_NE(reg.find(id), nullptr) << id;
  ASSERT_NE(reg.find("test-copy"), nullptr);
  EXPECT_EQ(reg.find("test-copy")->library, plugin("duplicate"));
  EXPECT_EQ(reg.find("test-echo"), nullptr);
}

TEST(TaskRegistry, LoadDirTakesOnlySharedLibraries) {
  const auto dir = hh::test::scratch_dir("registry");
  fs::copy_file(plugin("good"), dir / "good.so");
  std::ofstream(dir / "README.txt") << "notes\n";
  fs::create_directories(dir / "sub.so");
  TaskRegistry reg;
  reg.load_dir(dir);
  EXPECT_TRUE(reg.diagnostics().empty());
  EXPECT_EQ(reg.tasks().size(), 2u);
}

TEST(TaskRegistry, SameLibraryTwiceLoadsOnce) {
  TaskRegistry reg;
  EXPECT_TRUE(reg.load_library(plugin("good")));
  EXPECT_TRUE(reg.load_library(fs::path(HH_TEST_PLUGIN_DIR) / "." / "good.so"));
  EXPECT_TRUE(reg.diagnostics().empty());
  EXPECT_EQ(reg.tasks().size(), 2u);
}

TEST(TaskRegistry, MissingDirectoryIsADiagnostic) {
  const auto dir = hh::test::scratch_dir("registry") / "absent";
  TaskRegistry reg;
  reg.load_dir(dir);
  ASSERT_EQ(reg.diagnostics().size(), 1u);
  EXPECT_NE(reg.diagnostics()[0].find(dir.string()), std::string::npos);
}

TEST(TaskRegistry, DefaultSearchPathOrder) {
  const fs::path exe = fs::read_symlink("/proc/self/exe");
  const fs::path build_dir = (exe.parent_path() / ".." / "lib" / "hydrahead" / "plugins").lexically_normal();
  {
    ScopedEnv xdg("XDG_DATA_HOME", "/xdg/data");
    ScopedEnv path("HYDRAHEAD_PLUGIN_PATH", "/one::/two/");
    const auto dirs = TaskRegistry::default_search_path();
    ASSERT_EQ(dirs.size(), 4u);
    EXPECT_EQ(dirs[0], build_dir);
    EXPECT_EQ(dirs[1], fs::path("/xdg/data/hydrahead/plugins"));
    EXPECT_EQ(dirs[2], fs::path("/one"));
    EXPECT_EQ(dirs[3], fs::path("/two/"));
  }
  {
    ScopedEnv xdg("XDG_DATA_HOME", nullptr);
    ScopedEnv home("HOME", "/home/someone");
    ScopedEnv path("HYDRAHEAD_PLUGIN_PATH", nullptr);
    const auto dirs = TaskRegistry::default_search_path();
    ASSERT_EQ(dirs.size(), 2u);
    EXPECT_EQ(dirs[1], fs::path("/home/someone/.local/share/hydrahead/plugins"));
  }
}

TEST(TaskRegistry, LoadDefaultFindsPluginsOnTheEnvironmentPath) {
  const auto dir = hh::test::scratch_dir("registry");
  fs::copy_file(plugin("good"), dir / "good.so");
  ScopedEnv xdg("XDG_DATA_HOME", (dir / "xdg").c_str());
  ScopedEnv path("HYDRAHEAD_PLUGIN_PATH", dir.c_str());
  TaskRegistry reg;
  reg.load_default();
  ASSERT_NE(reg.find("test-copy"), nullptr);
  EXPECT_EQ(reg.find("test-copy")->library, dir / "good.so");
}

TEST(TaskRegistry, ResolveParamsFillsDefaults) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  const json all = reg.resolve_params("test-copy", json::object());
  EXPECT_EQ(all, json::parse(R"({"num_examples": 3, "length": 6, "depth": 0.5, "mode": "last", "with_text": true})"));
  EXPECT_EQ(reg.resolve_params("test-copy", nullptr), all);
  const json some = reg.resolve_params("test-copy", {{"length", 9}, {"mode", "first"}, {"depth", 1}});
  EXPECT_EQ(some["length"], 9);
  EXPECT_EQ(some["mode"], "first");
  EXPECT_EQ(some["depth"].get<double>(), 1.0);
  EXPECT_EQ(some["num_examples"], 3);
  // An integral float is an integer.
  EXPECT_EQ(reg.resolve_params("test-copy", {{"length", 7.0}})["length"], 7);
}

TEST(TaskRegistry, ResolveParamsChecksTypesAndRanges) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  auto err = [&](const json& partial) { return error_of([&] { reg.resolve_params("test-copy", partial); }); };
  EXPECT_NE(err({{"length", 1}}).find("parameter 'length' = 1 is out of range [2, 64]"), std::string::npos);
  EXPECT_NE(err({{"length", 65}}).find("out of range [2, 64]"), std::string::npos);
  EXPECT_NE(err({{"length", "abc"}}).find("parameter 'length' must be an integer"), std::string::npos);
  EXPECT_NE(err({{"length", 2.5}}).find("must be an integer"), std::string::npos);
  EXPECT_NE(err({{"depth", 1.5}}).find("parameter 'depth' = 1.5 is out of range [0, 1]"), std::string::npos);
  EXPECT_NE(err({{"mode", "middle"}}).find("'middle' is not one of last, first"), std::string::npos);
  EXPECT_NE(err({{"with_text", 1}}).find("parameter 'with_text' must be true or false"), std::string::npos);
  EXPECT_NE(err(json::array()).find("must be a JSON object"), std::string::npos);
}

TEST(TaskRegistry, UnknownParameterIsNamedWithTheValidOnes) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  const auto msg = error_of([&] { reg.resolve_params("test-echo", {{"length", 4}}); });
  EXPECT_NE(msg.find("task 'test-echo' has no parameter 'length'; valid: num_examples"), std::string::npos) << msg;
  const auto msg2 = error_of([&] { reg.resolve_params("test-copy", {{"lenght", 4}}); });
  EXPECT_NE(msg2.find("'lenght'; valid: num_examples, length, depth, mode, with_text"), std::string::npos) << msg2;
}

TEST(TaskRegistry, UnknownTaskListsTheAvailableOnes) {
  TaskRegistry reg;
  EXPECT_NE(error_of([&] { reg.resolve_params("test-copy", {}); }).find("no task plugins are loaded"),
            std::string::npos);
  ASSERT_TRUE(reg.load_library(plugin("good")));
  const auto msg = error_of([&] { reg.generate("niah", {}, tiny_tokenizer(), 1); });
  EXPECT_NE(msg.find("unknown task 'niah'; available: test-copy, test-echo"), std::string::npos) << msg;
}

TEST(TaskRegistry, ParamTextParsesByType) {
  hh::interp::TaskParam p;
  p.name = "length";
  p.type = ParamType::Int;
  EXPECT_EQ(hh::interp::parse_param_text(p, "42"), json(42));
  EXPECT_NE(error_of([&] { hh::interp::parse_param_text(p, "4x"); }).find("parameter 'length': '4x' is not an integer"),
            std::string::npos);
  p.type = ParamType::Float;
  EXPECT_EQ(hh::interp::parse_param_text(p, "0.25"), json(0.25));
  EXPECT_THROW(hh::interp::parse_param_text(p, ""), hh::Error);
  p.type = ParamType::Bool;
  EXPECT_EQ(hh::interp::parse_param_text(p, "true"), json(true));
  EXPECT_EQ(hh::interp::parse_param_text(p, "0"), json(false));
  EXPECT_THROW(hh::interp::parse_param_text(p, "maybe"), hh::Error);
  p.type = ParamType::String;
  EXPECT_EQ(hh::interp::parse_param_text(p, "4x"), json("4x"));
}

TEST(TaskRegistry, GeneratesThroughTheTinyTokenizer) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  const auto& tok = tiny_tokenizer();
  std::vector<double> fractions;
  const auto examples = reg.generate("test-copy", {{"num_examples", 5}, {"length", 8}, {"depth", 1.0}}, tok,
                                     /*seed=*/11, [&](double f, std::size_t) { fractions.push_back(f); });
  ASSERT_EQ(examples.size(), 5u);
  for (const auto& ex : examples) {
    EXPECT_EQ(ex.task, "test-copy");
    EXPECT_EQ(ex.clean_ids, tok.encode(ex.clean));
    EXPECT_EQ(ex.corrupt_ids, tok.encode(ex.corrupt));
    EXPECT_EQ(ex.clean_ids.size(), 8u);
    EXPECT_EQ(ex.corrupt_ids.size(), 8u);
    EXPECT_EQ(hh::interp::first_difference(ex.clean_ids, ex.corrupt_ids), 7);
    EXPECT_EQ(ex.meta["pos"], 7);
    EXPECT_EQ(ex.answer_ids, tok.encode(ex.clean.substr(7)));
    EXPECT_EQ(ex.wrong_ids, tok.encode(ex.corrupt.substr(7)));
    EXPECT_NE(ex.answer_ids, ex.wrong_ids);
  }
  ASSERT_FALSE(fractions.empty());
  EXPECT_DOUBLE_EQ(fractions.back(), 1.0);

  // Same seed, same set; another seed, another set.
  const auto again = reg.generate("test-copy", {{"num_examples", 5}, {"length", 8}, {"depth", 1.0}}, tok, 11);
  const auto other = reg.generate("test-copy", {{"num_examples", 5}, {"length", 8}, {"depth", 1.0}}, tok, 12);
  for (std::size_t i = 0; i < examples.size(); ++i)
    EXPECT_EQ(hh::interp::calibration_line(examples[i]), hh::interp::calibration_line(again[i]));
  EXPECT_NE(hh::interp::calibration_line(examples[0]), hh::interp::calibration_line(other[0]));

  // Defaults only: the echo task's two examples of four digits, without text when asked.
  EXPECT_EQ(reg.generate("test-echo", {}, tok, 1).size(), 2u);
  const auto bare = reg.generate("test-copy", {{"with_text", false}}, tok, 1);
  EXPECT_TRUE(bare[0].clean.empty());
  EXPECT_EQ(bare[0].clean_ids.size(), 6u);
}

TEST(TaskRegistry, GeneratedSetRoundTripsThroughTheFile) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  const auto& tok = tiny_tokenizer();
  const auto examples = reg.generate("test-copy", {{"num_examples", 4}}, tok, 3);
  const auto file = hh::test::scratch_dir("registry") / "calib.jsonl";
  hh::interp::write_calibration(file, examples);
  const auto back = hh::interp::read_calibration(file, &tok, tok.vocab_size());
  ASSERT_EQ(back.size(), examples.size());
  for (std::size_t i = 0; i < back.size(); ++i)
    EXPECT_EQ(hh::interp::calibration_line(back[i]), hh::interp::calibration_line(examples[i]));
}

TEST(TaskRegistry, CancelStopsGeneration) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("good")));
  int polls = 0;
  auto cancel = [&] { return ++polls >= 2; };
  EXPECT_THROW(reg.generate("test-copy", {{"num_examples", 100}}, tiny_tokenizer(), 1, {}, cancel),
               hh::interp::Cancelled);
  EXPECT_EQ(polls, 2) << "polled once before starting, then after each example until it said stop";
}

TEST(TaskRegistry, BadExamplesFailNamingPluginFileAndTask) {
  TaskRegistry reg;
  ASSERT_TRUE(reg.load_library(plugin("bad_example")));
  const auto& tok = tiny_tokenizer();
  const std::string file = plugin("bad_example").string();
  auto err = [&](const char* id) { return error_of([&] { reg.generate(id, {}, tok, 1); }); };

  const auto bad_json = err("test-bad-json");
  EXPECT_NE(bad_json.find(file + ": task 'test-bad-json', example 1: not valid JSON"), std::string::npos) << bad_json;

  const auto lengths = err("test-bad-lengths");
  EXPECT_NE(lengths.find(file + ": task 'test-bad-lengths', example 2: field 'corrupt_ids' has 2 tokens"),
            std::string::npos)
      << lengths;

  const auto range = err("test-out-of-range");
  EXPECT_NE(range.find("task 'test-out-of-range', example 1: field 'answer_ids' item 0: id " +
                       std::to_string(tok.vocab_size()) + " is out of range"),
            std::string::npos)
      << range;

  const auto fails = err("test-fails");
  EXPECT_NE(fails.find(file + ": task 'test-fails' failed (status 7): ran out of haystack"), std::string::npos)
      << fails;
}

}  // namespace
