#pragma once
// The Eval view: NIAH accuracy grids (context length x needle depth) of the teacher and the hybrid
// side by side, each cell labelled with its accuracy, and their perplexities. It reads the files
// `hydrahead eval` writes (one model each: /niah/*, /ppl/*) and the eval.h5 of `hydrahead demo`
// (both models: /teacher/..., /hybrid/...).
#include <QString>
#include <QWidget>
#include <optional>
#include <vector>

class QCustomPlot;
class QLabel;

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

  // A file with /teacher and /hybrid groups fills both sides; a single model's file fills `side`.
  // Its /niah and /ppl parts are each optional, but a file with neither is refused by name.
  bool openFile(const QString& path, Side side, QString* error);
  const std::optional<NiahGrid>& grid(Side side) const { return grids_[side]; }
  std::optional<double> perplexity(Side side) const { return ppl_[side]; }
  QCustomPlot* plot(Side side) const { return plots_[side]; }
  QString summaryText() const;

 private:
  void redraw(Side side);

  std::optional<NiahGrid> grids_[2];
  std::optional<double> ppl_[2];
  QString files_[2];
  QCustomPlot* plots_[2];
  QLabel* titles_[2];
  QLabel* summary_;
};

}  // namespace hh::workbench
