// hydrahead-workbench: the Qt front end.
// Usage: hydrahead-workbench [--model DIR] [--analysis FILE] [--manifest FILE] [--run DIR] [--demo] [--screenshot FILE]
#include <QApplication>
#include <QCommandLineOption>
#include <QCommandLineParser>
#include <QTemporaryDir>
#include <QTimer>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/util/alloc.h"
#include "hydrahead/version.h"
#include "main_window.h"

namespace {

// Whether argv names one of the options, alone or as NAME=VALUE.
bool has_option(int argc, char** argv, std::initializer_list<const char*> names) {
  for (int i = 1; i < argc; ++i)
    for (const char* n : names) {
      const size_t len = std::strlen(n);
      if (std::strncmp(argv[i], n, len) == 0 && (argv[i][len] == 0 || argv[i][len] == '=')) return true;
    }
  return false;
}

// On Linux, Qt picks the X11 or Wayland platform; with neither server named and no platform chosen it
// aborts with a message about the xcb plugin that does not say what is missing.
bool no_display() {
#ifdef __linux__
  return qEnvironmentVariableIsEmpty("QT_QPA_PLATFORM") && qEnvironmentVariableIsEmpty("DISPLAY") &&
         qEnvironmentVariableIsEmpty("WAYLAND_DISPLAY");
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  hh::util::tune_allocator_for_tensors();
  const bool text_only = has_option(argc, argv, {"-h", "--help", "--help-all", "-v", "--version"});
  if (!text_only && no_display()) {
    if (!has_option(argc, argv, {"--screenshot"})) {
      std::fprintf(stderr,
                   "hydrahead-workbench: no display (DISPLAY and WAYLAND_DISPLAY are unset). Run it on a desktop or "
                   "with X forwarding (ssh -X), or set QT_QPA_PLATFORM; --screenshot FILE renders without a display. "
                   "`hydrahead` does every step headless (`hydrahead --help`).\n");
      return 1;
    }
    qputenv("QT_QPA_PLATFORM", "offscreen");  // a picture needs no screen
  }
  // --help and --version print and exit before any window system is needed.
  std::unique_ptr<QCoreApplication> app;
  if (text_only) app = std::make_unique<QCoreApplication>(argc, argv);
  else app = std::make_unique<QApplication>(argc, argv);
  QCoreApplication::setOrganizationName(QStringLiteral("HydraHead"));
  QCoreApplication::setApplicationName(QStringLiteral("hydrahead-workbench"));
  QCoreApplication::setApplicationVersion(QStringLiteral(HYDRAHEAD_VERSION));
  if (!text_only) QApplication::setApplicationDisplayName(QStringLiteral("HydraHead Workbench"));

  QCommandLineParser parser;
  parser.setApplicationDescription(QStringLiteral(
      "HydraHead Workbench: inspect a dense transformer checkpoint and convert it into a head-level hybrid."));
  parser.addHelpOption();
  parser.addVersionOption();
  const QCommandLineOption model({QStringLiteral("m"), QStringLiteral("model")},
                                 QStringLiteral("Open the checkpoint folder <DIR> (config.json and *.safetensors)."),
                                 QStringLiteral("DIR"));
  parser.addOption(model);
  const QCommandLineOption analysis({QStringLiteral("a"), QStringLiteral("analysis")},
                                    QStringLiteral("Open the analysis file <FILE> (from `hydrahead analyze`) in the Heads view."),
                                    QStringLiteral("FILE"));
  parser.addOption(analysis);
  const QCommandLineOption manifest(QStringLiteral("manifest"),
                                    QStringLiteral("Make the full-attention heads of <FILE> (a manifest.json) the selection."),
                                    QStringLiteral("FILE"));
  parser.addOption(manifest);
  const QCommandLineOption run(QStringLiteral("run"),
                               QStringLiteral("Show the training run directory <DIR> (its run.h5) in the Runs view; while "
                                              "its job runs (`hydrahead train` elsewhere), follow it."),
                               QStringLiteral("DIR"));
  parser.addOption(run);
  const QCommandLineOption screenshot(
      QStringLiteral("screenshot"),
      QStringLiteral("Render the window into the PNG <FILE> once what it names is open, then exit "
                     "(status 1 when something failed to open or the file cannot be written)."),
      QStringLiteral("FILE"));
  parser.addOption(screenshot);
  const QCommandLineOption demo(QStringLiteral("demo"),
                                QStringLiteral("Open the bundled demo model and run a quick analysis of it (results in a "
                                               "temporary folder); with --screenshot, the picture is taken when it is done."));
  parser.addOption(demo);
  parser.process(*app);
  if (text_only) parser.showHelp(0);  // (where --help was taken as an option's value: no window without a QApplication)

  hh::workbench::MainWindow window;
  const bool scripted = parser.isSet(screenshot);
  window.setInteractive(!scripted);
  bool ok = true;
  if (scripted) {
    QObject::connect(&window, &hh::workbench::MainWindow::loadFailed, [](const QString& message) {
      std::fprintf(stderr, "hydrahead-workbench: %s\n", message.toLocal8Bit().constData());
    });
  }
  window.show();
  if (parser.isSet(model)) ok = window.openCheckpoint(parser.value(model)) && ok;
  if (parser.isSet(analysis)) ok = window.openAnalysis(parser.value(analysis)) && ok;
  if (parser.isSet(manifest)) ok = window.importManifest(parser.value(manifest)) && ok;
  if (parser.isSet(run)) ok = window.openRun(parser.value(run)) && ok;
  QTemporaryDir demo_dir;
  bool demo_running = false;
  if (parser.isSet(demo)) {
    demo_running = window.runDemo(demo_dir.path());
    ok = demo_running && ok;
  }
  if (scripted) {
    const QString file = parser.value(screenshot);
    auto shoot = [&window, file](bool fine) {
      const bool saved = window.grab().save(file, "PNG");
      if (!saved) std::fprintf(stderr, "hydrahead-workbench: cannot write %s\n", file.toLocal8Bit().constData());
      QApplication::exit(fine && saved ? 0 : 1);
    };
    if (demo_running) {  // after the analysis
      QObject::connect(&window, &hh::workbench::MainWindow::analysisLoaded, &window, [shoot, &ok] { shoot(ok); });
      QObject::connect(&window, &hh::workbench::MainWindow::analysisFailed, &window, [](const QString& message) {
        std::fprintf(stderr, "hydrahead-workbench: %s\n", message.toLocal8Bit().constData());
        QApplication::exit(1);
      });
    } else {
      QTimer::singleShot(0, &window, [shoot, ok] { shoot(ok); });
    }
  }
  return app->exec();
}
