#pragma once
// The Heads view: a layers x query-heads heatmap of any per-head signal of an analysis.h5 (noising,
// denoising, attribution, path, retrieval score, the task-split noising maps and their composite),
// on a diverging colour scale centred on zero, with the KV-group boundaries drawn and the
// full-attention heads outlined. Hovering a cell names it (layer, head, KV group, value, rank);
// clicking toggles the head between full and linear attention (undoable, through HeadSelection);
// the panel beside the map lists every signal of the last clicked head and its per-example effects.
#include <QFutureWatcher>
#include <QString>
#include <QStringList>
#include <QWidget>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <vector>

class QComboBox;
class QCPColorMap;
class QCPColorScale;
class QCPItemRect;
class QCustomPlot;
class QLabel;
class QMouseEvent;
class QTableWidget;

class QSpinBox;

namespace hh::select {
struct Signals;
}
namespace hh::interp {
struct CalibExample;
}
namespace hh::model {
class Tokenizer;
class Transformer;
}

namespace hh::workbench {

class HeadSelection;
class SelectionPanel;
struct AttentionInputs;
struct AttentionResult;

class HeadsView : public QWidget {
  Q_OBJECT

 public:
  explicit HeadsView(HeadSelection* selection, QWidget* parent = nullptr);
  ~HeadsView() override;

  // Loads the per-head maps of `path` (a hydrahead analysis.h5) and resets the selection to its grid.
  // On failure returns false with *error naming the file and what is wrong; the current map stays.
  bool openAnalysis(const QString& path, QString* error);
  QString analysisPath() const { return path_; }
  bool hasAnalysis() const { return !path_.isEmpty(); }

  // Maps in the file, in the core's order, then "composite" (DESIGN's default weights).
  QStringList signalNames() const;
  QString currentSignal() const;
  void setSignal(const QString& name);

  int layers() const { return layers_; }
  int queryHeads() const { return heads_; }
  int kvGroupSize() const { return group_; }
  // The shown map's value (NaN where the file has none) and rank (1 = largest; 0 for NaN).
  double value(int layer, int head) const;
  int rank(int layer, int head) const;
  QString tooltipFor(int layer, int head) const;

  QCustomPlot* plot() const { return plot_; }
  QCPColorMap* colorMap() const { return map_; }
  // Centre of a cell in plot() coordinates, and the cell under a point (false outside the grid).
  QPoint cellCenter(int layer, int head) const;
  bool cellAt(const QPoint& pos, int* layer, int* head) const;
  int outlinedHeads() const { return static_cast<int>(outlines_.size()); }
  // The head the detail panel describes, (-1, -1) before the first click.
  std::pair<int, int> detailHead() const { return detail_; }
  QTableWidget* detailTable() const { return detail_table_; }
  SelectionPanel* selectionPanel() const { return panel_; }
  const select::Signals* analysisSignals() const { return signals_.get(); }

  // The clicked head's attention on calibration example `index` (of the file's calibration set, run
  // through the file's model): rows = the positions that predict answer tokens, columns = tokens.
  // The model and the set load on first use and the forward runs on a worker thread, so the window
  // stays responsive; the plot and attentionText() follow when it is done (attentionBusy() false,
  // attentionShown() emitted), or the label names what went wrong. Returns false with *error at once
  // when nothing can start (no clicked head, no model or calibration set named, an example out of
  // range of a set already read). After the first call (the panel's Show button), each clicked head
  // shows its attention too. A request made while one runs replaces any waiting one.
  bool showAttention(int index, QString* error);
  bool attentionBusy() const;
  // The rows last shown, [A x T] row-major, and their shape.
  const std::vector<double>& attentionRows() const { return attn_rows_; }
  std::pair<int, int> attentionShape() const { return attn_shape_; }
  QCustomPlot* attentionPlot() const { return attn_plot_; }
  QString attentionText() const;

 Q_SIGNALS:
  void headClicked(int layer, int head);
  void analysisOpened(const QString& path);
  void attentionShown();

 private:
  void redraw();
  void updateOutlines();
  void showDetail(int layer, int head);
  void onMouseMove(QMouseEvent* event);
  void onMousePress(QMouseEvent* event);
  const std::vector<double>* currentMap() const;
  double valueIn(const std::vector<double>* map, int layer, int head) const;
  int rankIn(const std::vector<double>* map, int layer, int head) const;
  struct AttentionRequest {
    int index = 0, layer = 0, head = 0;
    int generation = 0;  // of the analysis file it was made for
  };
  void startAttention(const AttentionRequest& r);
  void onAttentionReady();

  HeadSelection* selection_;
  std::unique_ptr<select::Signals> signals_;
  QString path_;
  int layers_ = 0, heads_ = 0, group_ = 1;
  std::map<QString, std::vector<double>> maps_;   // name -> [L * Hq]
  QStringList order_;
  // Per-example normalised noising effect [N][L * Hq] and the examples' task ids (empty when absent).
  std::vector<std::vector<double>> per_example_;
  QStringList example_tasks_;
  std::pair<int, int> detail_{-1, -1};

  QComboBox* signal_box_;
  QLabel* caption_;
  QCustomPlot* plot_;
  QCPColorMap* map_;
  QCPColorScale* scale_;
  std::vector<QCPItemRect*> outlines_;
  QLabel* detail_title_;
  QTableWidget* detail_table_;
  QTableWidget* example_table_;
  SelectionPanel* panel_;
  QSpinBox* example_spin_;
  QCustomPlot* attn_plot_;
  QLabel* attn_label_;
  QString model_path_, calib_path_;  // from the analysis file's attributes
  // The model, tokenizer and calibration set, read by the first attention request (immutable once
  // read, shared with the worker).
  std::shared_ptr<const AttentionInputs> inputs_;
  QFutureWatcher<std::shared_ptr<AttentionResult>> attn_watcher_;
  AttentionRequest pending_;                      // the request the worker runs (while attn_running_)
  bool attn_running_ = false;                     // from its start until its result is handled
  std::optional<AttentionRequest> next_request_;  // made while another ran
  int generation_ = 0;                            // bumped by openAnalysis: older results are dropped
  // Raised for the worker's request when openAnalysis moves to another file or the view closes.
  std::shared_ptr<std::atomic<bool>> attn_cancel_ = std::make_shared<std::atomic<bool>>(false);
  std::vector<double> attn_rows_;
  std::pair<int, int> attn_shape_{0, 0};
  bool attention_on_ = false;  // a click runs a forward only once the user asked for attention
};

}  // namespace hh::workbench
