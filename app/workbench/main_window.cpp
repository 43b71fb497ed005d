#include "main_window.h"

#include <QAction>
#include <QApplication>
#include <QCloseEvent>
#include <QCoreApplication>
#include <QDir>
#include <QDragEnterEvent>
#include <QDropEvent>
#include <QFile>
#include <QFileDialog>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QLabel>
#include <QListWidget>
#include <QMenu>
#include <QMenuBar>
#include <QMessageBox>
#include <QMimeData>
#include <QStackedWidget>
#include <QDockWidget>
#include <QPlainTextEdit>
#include <QPointer>
#include <QStatusBar>
#include <QTime>
#include <set>
#include <QUndoStack>
#include <exception>
#include <torch/version.h>

#include "core/util/error.h"
#include "core/util/log.h"
#include "core/select/manifest.h"
#include "head_selection.h"
#include "heads_view.h"
#include "analysis_view.h"
#include "calibration_view.h"
#include "eval_view.h"
#include "layers_view.h"
#include "runs_view.h"
#include "hydrahead/version.h"
#include "model_view.h"
#include "recent_checkpoints.h"
#include "selection_panel.h"
#include "settings.h"
#include "style_helpers.h"
#include "qt_util.h"

namespace hh::workbench {
namespace {

constexpr int kNavigationWidth = 168;      // px
constexpr int kRecentMenuTextWidth = 460;  // px; longer paths are elided in the middle
constexpr int kErrorStatusTimeoutMs = 10000;
constexpr QSize kDefaultWindowSize{1280, 800};


class OverrideCursor {
 public:
  OverrideCursor() { QApplication::setOverrideCursor(Qt::WaitCursor); }
  ~OverrideCursor() { QApplication::restoreOverrideCursor(); }
  OverrideCursor(const OverrideCursor&) = delete;
  OverrideCursor& operator=(const OverrideCursor&) = delete;
};


// The folder's own name ("Qwen3-0.6B"), or the whole path where it has none ("/").
QString displayName(const QString& dir) {
  const QString name = QFileInfo(QDir::cleanPath(dir)).fileName();
  return name.isEmpty() ? dir : name;
}

bool isCheckpointFile(const QFileInfo& info) {
  return info.fileName() == QLatin1String("config.json") || info.suffix() == QLatin1String("safetensors") ||
         info.fileName().endsWith(QLatin1String(".safetensors.index.json"));
}

}  // namespace

QString checkpointFolderFromDrop(const QList<QUrl>& urls) {
  for (const QUrl& url : urls) {
    if (!url.isLocalFile()) continue;
    const QFileInfo info(url.toLocalFile());
    if (info.isDir()) return info.absoluteFilePath();
    if (info.isFile() && isCheckpointFile(info)) return info.absolutePath();
  }
  return {};
}

MainWindow::MainWindow(QWidget* parent) : QMainWindow(parent) {
  setAcceptDrops(true);
  createPages();
  createLogPanel();
  createMenus();

  model_status_ = new QLabel(tr("No model open"), this);
  model_status_->setObjectName(QStringLiteral("modelStatus"));
  statusBar()->addWidget(model_status_, 1);

  setWindowTitle(QApplication::applicationDisplayName());
  resize(kDefaultWindowSize);
  const QByteArray geometry = options::kWindowGeometry.get();
  if (!geometry.isEmpty()) restoreGeometry(geometry);
  const QByteArray state = options::kWindowState.get();
  if (!state.isEmpty()) restoreState(state);
}

void MainWindow::createPages() {
  navigation_ = new QListWidget(this);
  navigation_->setObjectName(QStringLiteral("navigation"));
  navigation_->setFixedWidth(kNavigationWidth);
  navigation_->setFrameShape(QFrame::NoFrame);
  // A border rule switches items to style-sheet painting, which is what makes the padding apply;
  // selection then needs its own rule.
  navigation_->setStyleSheet(QStringLiteral(
      "QListWidget { padding-top: 8px; }"
      "QListWidget::item { border: none; padding: 7px 14px; }"
      "QListWidget::item:selected { background: palette(highlight); color: palette(highlighted-text); }"));
  QPalette nav = navigation_->palette();
  nav.setColor(QPalette::Base, palette().color(QPalette::Window).darker(106));
  navigation_->setPalette(nav);

  pages_ = new QStackedWidget(this);
  model_view_ = new ModelView(pages_);
  connect(model_view_, &ModelView::openRequested, this, &MainWindow::openCheckpointDialog);
  selection_ = new HeadSelection(this);
  heads_view_ = new HeadsView(selection_, pages_);
  layers_view_ = new LayersView(pages_);
  runs_view_ = new RunsView(pages_);
  analysis_view_ = new AnalysisView(pages_);
  connect(analysis_view_, &AnalysisView::analysisWritten, this, [this](const QString& path) { openAnalysis(path); });
  connect(analysis_view_, &AnalysisView::analysisFailed, this, &MainWindow::analysisFailed);

  calibration_view_ = new CalibrationView(pages_);
  eval_view_ = new EvalView(pages_);
  connect(calibration_view_, &CalibrationView::useForAnalysis, this, [this](const QString& file) {
    analysis_view_->setCalibration(file);
    showPage(Page::Analysis);
  });
  // In Page order.
  const std::pair<QWidget*, QString> pages[] = {
      {model_view_, tr("The open checkpoint: configuration, heads and tensors")},
      {calibration_view_, tr("Make or load a calibration set and read its prompts")},
      {analysis_view_, tr("Run the causal analysis on the open model, with progress and cancel")},
      {heads_view_, tr("Per-head maps of an analysis.h5; click a head to make it full attention")},
      {layers_view_, tr("Layer similarity of an analysis.h5, with blocks of alike layers outlined")},
      {runs_view_, tr("Training jobs: launch, follow the losses live, cancel and resume")},
      {eval_view_, tr("NIAH grids and perplexity of teacher and hybrid, side by side")},
  };
  const char* const names[] = {QT_TR_NOOP("Model"), QT_TR_NOOP("Calibration"), QT_TR_NOOP("Analysis"),
                               QT_TR_NOOP("Heads"), QT_TR_NOOP("Layers"), QT_TR_NOOP("Runs"), QT_TR_NOOP("Eval")};
  for (size_t i = 0; i < std::size(pages); ++i) {
    auto* item = new QListWidgetItem(tr(names[i]), navigation_);
    item->setToolTip(pages[i].second);
    pages_->addWidget(pages[i].first);
  }
  connect(navigation_, &QListWidget::currentRowChanged, pages_, &QStackedWidget::setCurrentIndex);
  navigation_->setCurrentRow(static_cast<int>(Page::Model));

  auto* separator = new QFrame(this);
  separator->setFrameShape(QFrame::VLine);
  separator->setFrameShadow(QFrame::Sunken);

  auto* central = new QWidget(this);
  auto* layout = new QHBoxLayout(central);
  layout->setContentsMargins(0, 0, 0, 0);
  layout->setSpacing(0);
  layout->addWidget(navigation_);
  layout->addWidget(separator);
  layout->addWidget(pages_, 1);
  setCentralWidget(central);
}

void MainWindow::createMenus() {
  QMenu* file = menuBar()->addMenu(tr("&File"));
  QAction* open = file->addAction(tr("&Open Checkpoint\u2026"), this, &MainWindow::openCheckpointDialog);
  open->setShortcut(QKeySequence::Open);
  open->setStatusTip(tr("Open a checkpoint folder (config.json and *.safetensors)"));
  recent_menu_ = file->addMenu(tr("Open &Recent"));
  recent_menu_->setObjectName(QStringLiteral("recentMenu"));
  recent_menu_->setToolTipsVisible(true);
  connect(recent_menu_, &QMenu::aboutToShow, this, &MainWindow::refreshRecentMenu);
  QAction* openAnalysisAction = file->addAction(tr("Open &Analysis\u2026"), this, &MainWindow::openAnalysisDialog);
  openAnalysisAction->setShortcut(QKeySequence(Qt::CTRL | Qt::SHIFT | Qt::Key_O));
  openAnalysisAction->setStatusTip(tr("Open an analysis.h5 written by `hydrahead analyze`"));
  QAction* importAction = file->addAction(tr("&Import Manifest\u2026"), this, &MainWindow::importManifestDialog);
  importAction->setStatusTip(tr("Take the full-attention heads of a manifest.json (from `hydrahead select`)"));
  QAction* exportAction = file->addAction(tr("&Export Manifest\u2026"), this, &MainWindow::exportManifestDialog);
  exportAction->setShortcut(QKeySequence(Qt::CTRL | Qt::Key_E));
  exportAction->setStatusTip(tr("Write the selected full-attention heads as manifest.json, as `hydrahead select` would"));
  file->addSeparator();
  QAction* quit = file->addAction(tr("&Quit"), this, &QWidget::close);
  quit->setShortcut(QKeySequence::Quit);
  quit->setMenuRole(QAction::QuitRole);

  QMenu* edit = menuBar()->addMenu(tr("&Edit"));
  QAction* undo = selection_->undoStack()->createUndoAction(edit, tr("&Undo"));
  undo->setShortcut(QKeySequence::Undo);
  QAction* redo = selection_->undoStack()->createRedoAction(edit, tr("&Redo"));
  redo->setShortcut(QKeySequence::Redo);
  edit->addAction(undo);
  edit->addAction(redo);

  QMenu* view = menuBar()->addMenu(tr("&View"));
  QAction* showLog = log_dock_->toggleViewAction();
  showLog->setText(tr("&Log"));
  showLog->setShortcut(QKeySequence(Qt::CTRL | Qt::Key_L));
  view->addAction(showLog);

  QMenu* help = menuBar()->addMenu(tr("&Help"));
  QAction* about = help->addAction(tr("&About HydraHead Workbench"), this, &MainWindow::showAbout);
  about->setMenuRole(QAction::AboutRole);
  QAction* aboutQt = help->addAction(tr("About &Qt"), qApp, &QApplication::aboutQt);
  aboutQt->setMenuRole(QAction::AboutQtRole);

  refreshRecentMenu();
}

MainWindow::Page MainWindow::currentPage() const { return static_cast<Page>(pages_->currentIndex()); }

void MainWindow::showPage(Page page) { navigation_->setCurrentRow(static_cast<int>(page)); }

QString MainWindow::modelStatusText() const { return model_status_->text(); }

QStringList MainWindow::recentCheckpoints() const { return options::kRecentCheckpoints.get(); }

bool MainWindow::openCheckpoint(const QString& dir) {
  if (dir.isEmpty()) return false;
  std::optional<ModelSummary> loaded;
  {
    OverrideCursor busy;
    try {
      loaded = summarize_checkpoint(toPath(dir));
    } catch (const hh::Error& e) {
      reportError(dir, QString::fromStdString(e.what()));
      return false;
    } catch (const std::exception& e) {
      // Anything the core did not wrap (I/O, allocation) is still reported rather than fatal.
      reportError(dir, tr("%1: %2").arg(dir, QString::fromStdString(e.what())));
      return false;
    }
  }
  model_ = std::move(loaded);
  model_view_->setSummary(*model_);
  analysis_view_->setModelDir(fromPath(model_->dir));
  calibration_view_->setModelDir(fromPath(model_->dir));
  showPage(Page::Model);

  const QString name = QString::fromStdString(model_->name);
  const QString path = fromPath(model_->dir);
  model_status_->setText(tr("%1 \u00b7 %2 parameters \u00b7 %3")
                             .arg(name, QString::fromStdString(format_parameter_count(model_->params_from_config)),
                                  QString::fromStdString(fingerprint_prefix(model_->fingerprint))));
  model_status_->setToolTip(path);
  statusBar()->clearMessage();
  setWindowTitle(tr("%1 \u2014 %2").arg(name, QApplication::applicationDisplayName()));
  setWindowFilePath(path);
  rememberRecent(path);
  Q_EMIT modelLoaded(path);
  return true;
}

void MainWindow::reportError(const QString& dir, const QString& message, const QString& what) {
  statusBar()->showMessage(tr("Could not open %1").arg(dir), kErrorStatusTimeoutMs);
  log::error(message.toStdString());
  Q_EMIT loadFailed(message);
  if (!interactive_) return;
  const QString kind = !what.isEmpty() ? what : QFileInfo(dir).isDir() ? tr("checkpoint") : QString();
  QMessageBox box(QMessageBox::Critical, kind.isEmpty() ? tr("Could not open file") : tr("Could not open %1").arg(kind),
                  kind.isEmpty() ? tr("Could not use \u201c%1\u201d.").arg(displayName(dir))
                                 : tr("Could not open the %1 \u201c%2\u201d.").arg(kind, displayName(dir)),
                  QMessageBox::Ok, this);
  QString details = message;
  if (model_) details += tr("\n\n%1 stays open.").arg(QString::fromStdString(model_->name));
  box.setInformativeText(details);
  box.exec();
}

QString MainWindow::demoModelDir() {
  const QString env = qEnvironmentVariable("HH_DEMO_MODEL");
  if (!env.isEmpty()) return env;
  const QDir app(QCoreApplication::applicationDirPath());
  for (const QString& rel : {QStringLiteral("../../datasets/models/hydrahead-demo"),
                             QStringLiteral("../share/hydrahead/models/hydrahead-demo"),
                             QStringLiteral("../../../datasets/models/hydrahead-demo")}) {
    const QString dir = QDir::cleanPath(app.absoluteFilePath(rel));
    if (QFileInfo::exists(dir + QStringLiteral("/config.json"))) return dir;
  }
  return {};
}

bool MainWindow::runDemo(const QString& work_dir) {
  const QString model = demoModelDir();
  if (model.isEmpty()) {
    reportError(QStringLiteral("hydrahead-demo"),
                tr("the bundled demo model was not found next to this program (set HH_DEMO_MODEL to its folder)"));
    return false;
  }
  if (!openCheckpoint(model)) return false;
  QString error;
  if (!analysis_view_->generateCalibration(work_dir, 4, 512, &error)) {
    reportError(work_dir, error);
    return false;
  }
  analysis_view_->setOutput(QDir(work_dir).absoluteFilePath(QStringLiteral("analysis.h5")));
  QFile::remove(analysis_view_->output());  // a fresh file for this calibration set
  analysis_view_->setMethods({QStringLiteral("activation"), QStringLiteral("path"), QStringLiteral("attribution"),
                              QStringLiteral("retrieval"), QStringLiteral("similarity")});
  showPage(Page::Analysis);
  if (!analysis_view_->start(&error)) {
    reportError(work_dir, error);
    return false;
  }
  return true;
}

bool MainWindow::openAnalysis(const QString& path) {
  if (path.isEmpty()) return false;
  QString error;
  bool ok = false;
  {
    OverrideCursor busy;
    ok = heads_view_->openAnalysis(path, &error) && layers_view_->openAnalysis(path, &error);
  }
  if (!ok) {
    reportError(path, error);
    return false;
  }
  statusBar()->showMessage(tr("Opened %1").arg(QDir::toNativeSeparators(path)), kErrorStatusTimeoutMs);
  showPage(Page::Heads);
  Q_EMIT analysisLoaded(heads_view_->analysisPath());
  return true;
}

bool MainWindow::openRun(const QString& dir) {
  if (dir.isEmpty()) return false;
  QString error;
  if (!runs_view_->openRun(dir, &error)) {
    reportError(dir, error, tr("training run"));
    return false;
  }
  showPage(Page::Runs);
  return true;
}

bool MainWindow::importManifest(const QString& path) {
  if (path.isEmpty()) return false;
  try {
    const select::Manifest m = select::read_manifest(toPath(path));
    if (!heads_view_->hasAnalysis() && selection_->layers() == 0)
      selection_->setShape(static_cast<int>(m.model.num_layers), static_cast<int>(m.model.num_heads));
    if (m.model.num_layers != selection_->layers() || m.model.num_heads != selection_->queryHeads())
      throw Error(path.toStdString() + ": the manifest is for " + std::to_string(m.model.num_layers) + " layers x " +
                  std::to_string(m.model.num_heads) + " heads, the open analysis has " +
                  std::to_string(selection_->layers()) + " x " + std::to_string(selection_->queryHeads()));
    std::set<HeadRef> heads;
    for (const auto& [l, h] : m.fa_heads) heads.insert({static_cast<int>(l), static_cast<int>(h)});
    selection_->replace(heads, tr("Import %1").arg(QFileInfo(path).fileName()));
  } catch (const std::exception& e) {
    reportError(path, QString::fromStdString(e.what()));
    return false;
  }
  statusBar()->showMessage(tr("Imported %1: %2 full-attention heads").arg(QDir::toNativeSeparators(path)).arg(selection_->count()),
                           kErrorStatusTimeoutMs);
  return true;
}

bool MainWindow::exportManifest(const QString& path) {
  if (path.isEmpty()) return false;
  if (!heads_view_->selectionPanel()->exportManifest(path)) {
    reportError(path, tr("%1: %2").arg(path, heads_view_->selectionPanel()->exportError()));
    return false;
  }
  statusBar()->showMessage(tr("Wrote %1: %2 full-attention heads").arg(QDir::toNativeSeparators(path)).arg(selection_->count()),
                           kErrorStatusTimeoutMs);
  return true;
}

void MainWindow::exportManifestDialog() {
  const QString file = QFileDialog::getSaveFileName(this, tr("Export Manifest"), QStringLiteral("manifest.json"),
                                                    tr("Manifests (*.json)"));
  if (!file.isEmpty()) exportManifest(file);
}

void MainWindow::importManifestDialog() {
  const QString file = QFileDialog::getOpenFileName(this, tr("Import Manifest"), options::kLastOpenFolder.get(),
                                                    tr("Manifests (*.json);;All files (*)"));
  if (!file.isEmpty()) importManifest(file);
}

void MainWindow::openAnalysisDialog() {
  const QString file = QFileDialog::getOpenFileName(this, tr("Open Analysis"), options::kLastAnalysisFolder.get(),
                                                    tr("Analysis files (*.h5);;All files (*)"));
  if (file.isEmpty()) return;
  options::kLastAnalysisFolder.set(QFileInfo(file).absolutePath());
  openAnalysis(file);
}

void MainWindow::openCheckpointDialog() {
  QString start = options::kLastOpenFolder.get();
  if (model_) start = fromPath(model_->dir.parent_path());
  const QString dir = QFileDialog::getExistingDirectory(this, tr("Open Checkpoint Folder"), start);
  if (dir.isEmpty()) return;
  options::kLastOpenFolder.set(QFileInfo(dir).absolutePath());
  openCheckpoint(dir);
}

void MainWindow::rememberRecent(const QString& dir) {
  options::kRecentCheckpoints.set(withRecentCheckpoint(options::kRecentCheckpoints.get(), dir));
  refreshRecentMenu();
}

void MainWindow::refreshRecentMenu() {
  const QStringList stored = options::kRecentCheckpoints.get();
  const QStringList recent = withoutMissingCheckpoints(stored);
  if (recent != stored) options::kRecentCheckpoints.set(recent);

  recent_menu_->clear();
  const QFontMetrics metrics(recent_menu_->font());
  for (int i = 0; i < recent.size(); ++i) {
    const QString path = recent.at(i);
    const QString shown = metrics.elidedText(QDir::toNativeSeparators(path), Qt::ElideMiddle, kRecentMenuTextWidth);
    // Only the first nine get a mnemonic digit.
    const QString text = i < 9 ? QStringLiteral("&%1  %2").arg(i + 1).arg(shown) : shown;
    QAction* action = recent_menu_->addAction(text);
    action->setData(path);
    action->setToolTip(path);
    // Queued: opening rebuilds this menu, which must not delete the action while it emits.
    connect(
        action, &QAction::triggered, this,
        [this, path] {
          if (!openCheckpoint(path)) refreshRecentMenu();  // drops the entry if the folder is gone
        },
        Qt::QueuedConnection);
  }
  if (recent.isEmpty()) recent_menu_->addAction(tr("No recent checkpoints"))->setEnabled(false);
  recent_menu_->addSeparator();
  QAction* clear = recent_menu_->addAction(tr("&Clear Menu"), this, &MainWindow::clearRecentCheckpoints);
  clear->setEnabled(!recent.isEmpty());
}

void MainWindow::clearRecentCheckpoints() {
  options::kRecentCheckpoints.reset();
  refreshRecentMenu();
}

void MainWindow::showAbout() {
  QMessageBox::about(
      this, tr("About HydraHead Workbench"),
      tr("<h3>HydraHead Workbench %1</h3>"
         "<p>Converts a pretrained dense transformer into a head-level hybrid: a few retrieval-critical "
         "query heads keep full softmax attention and the rest become Gated DeltaNet linear attention.</p>"
         "<p>See which heads matter, choose the full-attention set at a target ratio, export it as a "
         "manifest, and launch and watch conversion runs.</p>"
         "<p>Qt %2 \u00b7 LibTorch %3</p>")
          .arg(QStringLiteral(HYDRAHEAD_VERSION), QString::fromLatin1(qVersion()), QStringLiteral(TORCH_VERSION)));
}

void MainWindow::dragEnterEvent(QDragEnterEvent* event) {
  if (event->mimeData()->hasUrls() && !checkpointFolderFromDrop(event->mimeData()->urls()).isEmpty())
    event->acceptProposedAction();
}

void MainWindow::dropEvent(QDropEvent* event) {
  const QString dir = event->mimeData()->hasUrls() ? checkpointFolderFromDrop(event->mimeData()->urls()) : QString();
  if (dir.isEmpty()) return;
  event->acceptProposedAction();
  // Open after the drop returns, so the source application is not kept waiting (and a modal error
  // box does not run inside the drag-and-drop event loop).
  QMetaObject::invokeMethod(this, [this, dir] { openCheckpoint(dir); }, Qt::QueuedConnection);
}

void MainWindow::createLogPanel() {
  log_panel_ = new QPlainTextEdit(this);
  log_panel_->setObjectName(QStringLiteral("logPanel"));
  log_panel_->setReadOnly(true);
  log_panel_->setMaximumBlockCount(2000);
  log_dock_ = new QDockWidget(tr("Log"), this);
  log_dock_->setObjectName(QStringLiteral("logDock"));
  log_dock_->setWidget(log_panel_);
  addDockWidget(Qt::BottomDockWidgetArea, log_dock_);
  log_dock_->hide();
  // The core's log lines, from any thread, arrive here through the event loop.
  QPointer<QPlainTextEdit> panel(log_panel_);
  log::set_sink([panel](log::Level level, const std::string& message) {
    static const char* const names[] = {"debug", "info", "warning", "error"};
    const QString line = QStringLiteral("%1  %2: %3")
                             .arg(QTime::currentTime().toString(QStringLiteral("HH:mm:ss")),
                                  QLatin1String(names[static_cast<int>(level)]), QString::fromStdString(message));
    QMetaObject::invokeMethod(
        qApp, [panel, line] { if (panel) panel->appendPlainText(line); }, Qt::QueuedConnection);
  });
}

QString MainWindow::logText() const { return log_panel_->toPlainText(); }

MainWindow::~MainWindow() { log::set_sink({}); }

void MainWindow::closeEvent(QCloseEvent* event) {
  options::kWindowGeometry.set(saveGeometry());
  options::kWindowState.set(saveState());
  QMainWindow::closeEvent(event);
}

}  // namespace hh::workbench
