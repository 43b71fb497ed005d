#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "app/cli/commands.h"
#include "core/util/error.h"
#include "core/util/strings.h"

namespace hh::cli {

std::vector<std::string> split_list(const std::string& s) { return util::split_list(s); }

std::vector<long long> parse_id_list(const std::string& s, const std::string& what) {
  std::vector<long long> ids;
  const auto items = split_list(s);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto& item = items[i];
    size_t used = 0;
    long long v = 0;
    bool ok = !item.empty() && (std::isdigit(static_cast<unsigned char>(item[0])) || item[0] == '-');
    if (ok) {
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        ok = false;
      }
    }
    if (!ok || used != item.size())
      throw Error(what + ": item " + std::to_string(i) + " '" + item + "' is not an integer");
    ids.push_back(v);
  }
  if (ids.empty()) throw Error(what + ": no ids given");
  return ids;
}

namespace {

constexpr int kBarWidth = 30;          // characters between the brackets
constexpr double kRedrawSeconds = 0.2;  // at most five redraws a second

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::atomic<bool> g_interrupted{false};

extern "C" void on_interrupt(int sig) {
  g_interrupted.store(true);
  std::signal(sig, SIG_DFL);  // a second Ctrl-C ends the process at once
}

}  // namespace

ProgressBar::ProgressBar(std::string label)
    : label_(std::move(label)), tty_(isatty(STDERR_FILENO) == 1), start_s_(now_s()) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::update(double fraction, const std::string& detail) {
  if (!tty_) return;
  const double t = now_s();
  if (fraction < 1.0 && last_draw_s_ >= 0 && t - last_draw_s_ < kRedrawSeconds) return;
  last_draw_s_ = t;
  fraction = std::min(1.0, std::max(0.0, fraction));
  const int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(kBarWidth, '.');
  const double elapsed = t - start_s_;
  std::string eta;
  if (fraction > 0.0 && fraction < 1.0) eta = ", ETA " + format_seconds(elapsed * (1.0 - fraction) / fraction);
  std::fprintf(stderr, "\r\033[K%s [%s] %3d%% %s (%s%s)", label_.c_str(), bar.c_str(),
               static_cast<int>(fraction * 100.0), detail.c_str(), format_seconds(elapsed).c_str(), eta.c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::finish() {
  if (tty_ && drawn_) std::fputc('\n', stderr);
  drawn_ = false;
}

const std::atomic<bool>* install_interrupt_flag() {
  g_interrupted.store(false);
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
  return &g_interrupted;
}

}  // namespace hh::cli
