#pragma once
// The workbench window: File and Help menus, a navigation list of the views (Model now; Calibration,
// Analysis, Heads, Layers and Runs to come), the current page, and a status bar naming the open
// model. Opening a checkpoint goes through openCheckpoint(), whatever asked for it (menu, recent
// list, drop, command line).
#include <QList>
#include <QMainWindow>
#include <QUrl>
#include <optional>

#include "model_summary.h"

class QLabel;
class QListWidget;
class QMenu;
class QStackedWidget;

namespace hh::workbench {

class ModelView;

class MainWindow : public QMainWindow {
  Q_OBJECT
  // When false, errors are reported only through loadFailed() and the status bar, never in a modal
  // box (tests and scripted use).
  Q_PROPERTY(bool interactive READ isInteractive WRITE setInteractive)

 public:
  enum class Page { Model, Calibration, Analysis, Heads, Layers, Runs };

  explicit MainWindow(QWidget* parent = nullptr);

  bool isInteractive() const { return interactive_; }
  void setInteractive(bool on) { interactive_ = on; }

  // The open model, if any.
  const ModelSummary* currentModel() const { return model_ ? &*model_ : nullptr; }
  ModelView* modelView() const { return model_view_; }
  QListWidget* navigation() const { return navigation_; }
  Page currentPage() const;
  void showPage(Page page);
  QString modelStatusText() const;
  // The recent checkpoints as stored (newest first); refreshRecentMenu() drops missing ones.
  QStringList recentCheckpoints() const;
  QMenu* recentMenu() const { return recent_menu_; }

 public slots:
  // Opens the checkpoint folder `dir`; on failure reports the error and keeps the current model.
  bool openCheckpoint(const QString& dir);
  void openCheckpointDialog();
  void refreshRecentMenu();
  void clearRecentCheckpoints();
  void showAbout();

 signals:
  void modelLoaded(const QString& dir);
  void loadFailed(const QString& message);

 protected:
  void dragEnterEvent(QDragEnterEvent* event) override;
  void dropEvent(QDropEvent* event) override;
  void closeEvent(QCloseEvent* event) override;

 private:
  void createMenus();
  void createPages();
  void reportError(const QString& dir, const QString& message);
  void rememberRecent(const QString& dir);

  bool interactive_ = true;
  std::optional<ModelSummary> model_;
  QListWidget* navigation_ = nullptr;
  QStackedWidget* pages_ = nullptr;
  ModelView* model_view_ = nullptr;
  QMenu* recent_menu_ = nullptr;
  QLabel* model_status_ = nullptr;
};

// The checkpoint folder named by a drop, or an empty string: a dropped folder, or the folder of a
// dropped config.json / *.safetensors file.
QString checkpointFolderFromDrop(const QList<QUrl>& urls);

}  // namespace hh::workbench
