#pragma once
// The Eval view: NIAH accuracy grids (context length x needle depth) of the teacher and the hybrid
// side by side, each cell labelled with its accuracy, and their perplexities. It reads the files
// `hydrahead eval` writes (one model each: /niah/*, /ppl/*) and the eval.h5 of `hydrahead demo`
// (both models: /teacher/..., /hybrid/...).
#include <QProcess>
#include <QString>
#include <QTemporaryDir>
#include <QWidget>
#include <optional>
#include <vector>

class QComboBox;
class QCustomPlot;
class QLabel;
class QProgressBar;
class QLineEdit;
class QPushButton;

namespace hh::workbench {

struct NiahGrid {
  std::vector<int64_t> lengths;
  std::vector<double> depths;
  std::vector<double> accuracy;  // [lengths x depths] row-major
  double mean() const;
};

class EvalView : public QWidget {
  Q_OBJECT

 public:
  enum Side { Teacher = 0, Hybrid = 1 };
  explicit EvalView(QWidget* parent = nullptr);
  ~EvalView() override;  // an evaluation still running is killed

  // A file with /teacher and /hybrid groups fills both sides; a single model's file fills `side`.
  // Its /niah and /ppl parts are each optional, but a file with neither is refused by name.
  bool openFile(const QString& path, Side side, QString* error);
  const std::optional<NiahGrid>& grid(Side side) const { return grids_[side]; }
  std::optional<double> perplexity(Side side) const { return ppl_[side]; }
  QCustomPlot* plot(Side side) const { return plots_[side]; }
  QString summaryText() const;

  // Runs `hydrahead eval --task niah-grid` on `model_dir` at `lengths` ("512,1K") with `n` prompts a
  // cell on the chosen device, as a child process whose progress (prompts done, ETA) the view shows, and
  // opens its file on `side`; evaluated() or failed() follows.
  bool evaluate(const QString& model_dir, Side side, const QString& lengths, int n, QString* error);
  // Stops a running evaluation (SIGINT: it writes nothing); failed() follows.
  void cancel();
  void setProgram(const QString& path) { program_ = path; }
  bool isEvaluating() const { return proc_ && proc_->state() != QProcess::NotRunning; }
  QString device() const;         // cpu, or cuda where this build and machine have it
  bool setDevice(const QString& device);
  QString summaryLine() const;    // the line under the grids: the running evaluation's progress, else the summary

 Q_SIGNALS:
  void evaluated(int side);
  void failed(const QString& message);
  void progressed(int done, int total);

 private:
  void redraw(Side side);
  void onOutput();

  std::optional<NiahGrid> grids_[2];
  std::optional<double> ppl_[2];
  QString files_[2];
  QCustomPlot* plots_[2];
  QLabel* titles_[2];
  QLabel* summary_;
  QLineEdit* model_edit_[2];
  QLineEdit* lengths_;
  QPushButton* run_buttons_[2];
  QComboBox* device_;
  QProgressBar* progress_;
  QPushButton* cancel_button_;
  QString program_;
  QProcess* proc_ = nullptr;
  QByteArray pending_;
  QString last_line_, evaluating_;  // the child's last line that is not an event; the folder it evaluates
  bool cancelling_ = false;
  QTemporaryDir out_dir_;
};

}  // namespace hh::workbench
