#pragma once
// The Layers view: the layer-similarity matrices of an analysis.h5 (cosine of residual updates,
// linear CKA, angular distance) as L x L maps, with the blocks of consecutive alike layers that the
// core detects (interp::similarity_blocks) outlined; the threshold is adjustable. Hovering names the
// pair and its value.
#include <QString>
#include <QStringList>
#include <QWidget>
#include <map>
#include <utility>
#include <vector>

class QComboBox;
class QCPColorMap;
class QCustomPlot;
class QDoubleSpinBox;
class QLabel;
class QMouseEvent;

namespace hh::workbench {

class LayersView : public QWidget {
  Q_OBJECT

 public:
  explicit LayersView(QWidget* parent = nullptr);

  // Reads /similarity/* of `path`; a file without them shows a note and returns true with no metrics
  // (a heads-only analysis is not an error). False with *error when the file cannot be read.
  bool openAnalysis(const QString& path, QString* error);

  QStringList metrics() const;  // cosine_delta, cka, angular: those in the file
  QString currentMetric() const;
  void setMetric(const QString& name);
  double threshold() const;
  void setThreshold(double t);
  int layers() const { return layers_; }
  double value(int i, int j) const;  // of the current metric; NaN outside
  std::vector<std::pair<int, int>> blocks() const { return blocks_; }
  QString blocksText() const;
  QCustomPlot* plot() const { return plot_; }
  QCPColorMap* colorMap() const { return map_; }
  QString noteText() const;

 private:
  void redraw();
  void onMouseMove(QMouseEvent* event);

  int layers_ = 0;
  std::map<QString, std::vector<double>> mats_;  // name -> [L * L]
  std::vector<std::pair<int, int>> blocks_;
  QComboBox* metric_box_;
  QDoubleSpinBox* threshold_;
  QLabel* note_;
  QCustomPlot* plot_;
  QCPColorMap* map_;
};

}  // namespace hh::workbench
