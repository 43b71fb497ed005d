// `hydrahead`: the headless front end. Every step of the workbench is available here.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>

#include "app/cli/commands.h"
#include "core/util/alloc.h"
#include "core/util/error.h"
#include "hydrahead/version.h"

int main(int argc, char** argv) {
  hh::util::tune_allocator_for_tensors();
  hh::cli::set_command_line(argc, argv);
  CLI::App app{
      "hydrahead " HYDRAHEAD_VERSION
      " - turn a dense transformer into a head-level hybrid of full attention and Gated DeltaNet.\n"
      "Errors exit with status 1 and name the file, tensor or field at fault; usage errors exit 2."};
  app.set_version_flag("--version", std::string("hydrahead ") + HYDRAHEAD_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);

  std::map<CLI::App*, hh::cli::Runner> runners;
  auto reg = [&](hh::cli::Runner (*add)(CLI::App&), CLI::App* sub) { runners[sub] = add(*sub); };
  reg(hh::cli::add_inspect, app.add_subcommand("inspect", "Show a checkpoint's architecture, dimensions, parameters, KV groups and fingerprint"));
  reg(hh::cli::add_run, app.add_subcommand("run", "Run a forward pass and write logits (and hook activations) to HDF5"));
  reg(hh::cli::add_tokenize, app.add_subcommand("tokenize", "Encode text to token ids, or decode ids to text"));
  reg(hh::cli::add_tasks, app.add_subcommand("tasks", "Calibration-task plugins: list them, generate calibration sets (NIAH, passkey, ...), validate JSONL"));
  reg(hh::cli::add_analyze, app.add_subcommand("analyze", "Causal analysis: activation/path/attribution patching, retrieval score, layer similarity -> analysis.h5"));
  reg(hh::cli::add_select, app.add_subcommand("select", "Pick full-attention heads at a target LA:FA ratio, show the budget, write manifest.json"));
  reg(hh::cli::add_convert, app.add_subcommand("convert", "Convert a dense teacher + manifest into a HydraHead hybrid checkpoint"));
  reg(hh::cli::add_eval, app.add_subcommand("eval", "Needle-in-a-haystack accuracy over a grid of lengths and depths -> eval.h5"));
  reg(hh::cli::add_train, app.add_subcommand("train", "Run a training job: the three-stage transfer (align, distil, long-context fine-tune) or a pretrain, with checkpoints and a live run.h5"));
  reg(hh::cli::add_demo, app.add_subcommand("demo", "The whole pipeline on the bundled demo model: calibration, analysis, selection at 7:1, training, evaluation -> summary.json"));
  reg(hh::cli::add_bench, app.add_subcommand("bench", "Benchmarks: forward pass, tokenizer, patching sweeps (bench analyze), training steps (bench train), the LA heads' gated delta rule and the hybrid layer (bench gdn)"));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return hh::cli::kExitUnavailable;
  }

  for (auto* sub : app.get_subcommands()) {
    try {
      return runners.at(sub)();
    } catch (const hh::Error& e) {
      std::fprintf(stderr, "error: %s\n", e.what());
      hh::cli::report_failure_to_peers(e.what());
      return hh::cli::kExitError;
    } catch (const std::exception& e) {
      // LibTorch (c10::Error) and the standard library: still a clean message and status 1.
      std::string msg = e.what();
      if (auto nl = msg.find("\nException raised from"); nl != std::string::npos) msg.resize(nl);
      std::fprintf(stderr, "error: %s\n", msg.c_str());
      hh::cli::report_failure_to_peers(msg);
      return hh::cli::kExitError;
    }
  }
  return hh::cli::kExitUnavailable;
}
