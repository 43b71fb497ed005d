// hydrahead-workbench: the Qt front end. Usage: hydrahead-workbench [--model DIR]
#include <QApplication>
#include <QCommandLineOption>
#include <QCommandLineParser>

#include "core/util/alloc.h"
#include "hydrahead/version.h"
#include "main_window.h"

int main(int argc, char** argv) {
  hh::util::tune_allocator_for_tensors();
  QApplication app(argc, argv);
  QApplication::setOrganizationName(QStringLiteral("HydraHead"));
  QApplication::setApplicationName(QStringLiteral("hydrahead-workbench"));
  QApplication::setApplicationDisplayName(QStringLiteral("HydraHead Workbench"));
  QApplication::setApplicationVersion(QStringLiteral(HYDRAHEAD_VERSION));

  QCommandLineParser parser;
  parser.setApplicationDescription(QStringLiteral(
      "HydraHead Workbench: inspect a dense transformer checkpoint and convert it into a head-level hybrid."));
  parser.addHelpOption();
  parser.addVersionOption();
  const QCommandLineOption model({QStringLiteral("m"), QStringLiteral("model")},
                                 QStringLiteral("Open the checkpoint folder <DIR> (config.json and *.safetensors)."),
                                 QStringLiteral("DIR"));
  parser.addOption(model);
  parser.process(app);

  hh::workbench::MainWindow window;
  window.show();
  if (parser.isSet(model)) window.openCheckpoint(parser.value(model));
  return app.exec();
}
