#pragma once
// The selection controls beside the Heads map: LA:FA ratio, strategy, minimum per layer, seed and
// signal weights, applied live through the core's select::make_selection (the code behind
// `hydrahead select`), so the heads, the budget table and an exported manifest are what the CLI gives
// for the same inputs. Each applied change is one undo step; a ratio drag applies once, on release.
// Hand edits on the map make the selection "manual", and the budget and export follow them.
#include <QWidget>
#include <memory>

class QComboBox;
class QLabel;
class QLineEdit;
class QSlider;
class QSpinBox;
class QTableWidget;

namespace hh::select {
struct Signals;
struct SelectionReport;
}  // namespace hh::select

namespace hh::workbench {

class HeadSelection;

class SelectionPanel : public QWidget {
  Q_OBJECT

 public:
  SelectionPanel(HeadSelection* selection, QWidget* parent = nullptr);
  ~SelectionPanel() override;

  // A new analysis (null: none): the controls reset and the default strategy is applied.
  void setSignals(const select::Signals* signals);

  int ratio() const;
  void setRatio(int r);          // applies (one undo step)
  QString strategy() const;
  void setStrategy(const QString& s);  // applies
  void setMinPerLayer(int n);    // applies
  void setSeed(int seed);        // applies
  void setWeights(const QString& spec);  // "name=w,..." or empty for the default; applies
  QSlider* ratioSlider() const { return ratio_slider_; }
  QTableWidget* budgetTable() const { return budget_; }
  QString countText() const;
  QString applyError() const { return error_; }    // why the controls could not be applied ("" when fine)
  QString exportError() const { return export_error_; }

  // The manifest of the current selection (the strategy's, or "manual" after hand edits), written
  // atomically; false with exportError() set when it cannot be made or written.
  bool exportManifest(const QString& path);

 public Q_SLOTS:
  void apply();  // runs the strategy with the current controls and makes it the selection

 private:
  void refresh();  // count, budget and overlap for the selection as it is now
  std::unique_ptr<select::SelectionReport> report(bool manual) const;

  HeadSelection* selection_;
  const select::Signals* signals_ = nullptr;
  std::unique_ptr<select::SelectionReport> applied_;  // the last strategy result
  QString error_, export_error_;
  bool applying_ = false;

  QSlider* ratio_slider_;
  QLabel* ratio_label_;
  QComboBox* strategy_box_;
  QSpinBox* min_per_layer_;
  QSpinBox* seed_;
  QLineEdit* weights_;
  QLabel* count_;
  QLabel* overlap_;
  QTableWidget* budget_;
};

}  // namespace hh::workbench
