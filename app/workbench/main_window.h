#pragma once
// The workbench window: File, Edit and Help menus, a navigation list of the views (Model,
// Calibration, Analysis, Heads, Layers, Runs, Eval), the current page, and a status bar naming the open
// model. Opening a checkpoint goes through openCheckpoint(), whatever asked for it (menu, recent
// list, drop, command line).
#include <QList>
#include <QMainWindow>
#include <QUrl>
#include <optional>

#include "model_summary.h"

class QDockWidget;
class QLabel;
class QPlainTextEdit;
class QListWidget;
class QMenu;
class QStackedWidget;

namespace hh::workbench {

class HeadSelection;
class AnalysisView;
class CalibrationView;
class EvalView;
class HeadsView;
class LayersView;
class RunsView;
class ModelView;

class MainWindow : public QMainWindow {
  Q_OBJECT
  // When false, errors are reported only through loadFailed() and the status bar, never in a modal
  // box (tests and scripted use).
  Q_PROPERTY(bool interactive READ isInteractive WRITE setInteractive)

 public:
  enum class Page { Model, Calibration, Analysis, Heads, Layers, Runs, Eval };

  explicit MainWindow(QWidget* parent = nullptr);
  ~MainWindow() override;
  // What the log panel (View > Log) shows: the core's log lines and the errors reported here.
  QString logText() const;

  bool isInteractive() const { return interactive_; }
  void setInteractive(bool on) { interactive_ = on; }

  // The open model, if any.
  const ModelSummary* currentModel() const { return model_ ? &*model_ : nullptr; }
  ModelView* modelView() const { return model_view_; }
  HeadsView* headsView() const { return heads_view_; }
  LayersView* layersView() const { return layers_view_; }
  RunsView* runsView() const { return runs_view_; }
  AnalysisView* analysisView() const { return analysis_view_; }
  CalibrationView* calibrationView() const { return calibration_view_; }
  EvalView* evalView() const { return eval_view_; }
  // The bundled demo model: $HH_DEMO_MODEL, else found next to the program (build tree or install).
  static QString demoModelDir();
  HeadSelection* selection() const { return selection_; }
  QListWidget* navigation() const { return navigation_; }
  Page currentPage() const;
  void showPage(Page page);
  QString modelStatusText() const;
  // The recent checkpoints as stored (newest first); refreshRecentMenu() drops missing ones.
  QStringList recentCheckpoints() const;
  QMenu* recentMenu() const { return recent_menu_; }

 public Q_SLOTS:
  // Opens the checkpoint folder `dir`; on failure reports the error and keeps the current model.
  bool openCheckpoint(const QString& dir);
  void openCheckpointDialog();
  // Opens an analysis.h5 in the Heads view; on failure reports the error and keeps the current one.
  bool openAnalysis(const QString& path);
  void openAnalysisDialog();
  // Shows a training run directory in the Runs view (following it while its job runs elsewhere).
  bool openRun(const QString& dir);
  // Makes a manifest's FA heads the selection (one undoable step); the manifest must fit the grid.
  bool importManifest(const QString& path);
  void importManifestDialog();
  // Writes the current selection's manifest (what `hydrahead select` writes for the same choices).
  bool exportManifest(const QString& path);
  void exportManifestDialog();
  // Opens the demo model, writes a small calibration set into `work_dir` and starts its analysis; the
  // result opens in the Heads view when it is done (analysisLoaded) or analysisFailed is emitted.
  bool runDemo(const QString& work_dir);
  void refreshRecentMenu();
  void clearRecentCheckpoints();
  void showAbout();

 Q_SIGNALS:
  void modelLoaded(const QString& dir);
  void loadFailed(const QString& message);
  void analysisLoaded(const QString& path);
  void analysisFailed(const QString& message);

 protected:
  void dragEnterEvent(QDragEnterEvent* event) override;
  void dropEvent(QDropEvent* event) override;
  void closeEvent(QCloseEvent* event) override;

 private:
  void createMenus();
  void createPages();
  void createLogPanel();
  // Reports a failed open: status bar, log, loadFailed and (interactive) a box naming `what` was opened
  // (default: "checkpoint" for a folder, else a file).
  void reportError(const QString& dir, const QString& message, const QString& what = QString());
  void rememberRecent(const QString& dir);

  bool interactive_ = true;
  std::optional<ModelSummary> model_;
  QListWidget* navigation_ = nullptr;
  QStackedWidget* pages_ = nullptr;
  ModelView* model_view_ = nullptr;
  HeadSelection* selection_ = nullptr;
  HeadsView* heads_view_ = nullptr;
  LayersView* layers_view_ = nullptr;
  RunsView* runs_view_ = nullptr;
  AnalysisView* analysis_view_ = nullptr;
  CalibrationView* calibration_view_ = nullptr;
  EvalView* eval_view_ = nullptr;
  QMenu* recent_menu_ = nullptr;
  QLabel* model_status_ = nullptr;
  QPlainTextEdit* log_panel_ = nullptr;
  QDockWidget* log_dock_ = nullptr;
};

// The checkpoint folder named by a drop, or an empty string: a dropped folder, or the folder of a
// dropped config.json / *.safetensors file.
QString checkpointFolderFromDrop(const QList<QUrl>& urls);

}  // namespace hh::workbench
