#include "export.h"

#include <QFileDialog>
#include <QFileInfo>
#include <QMenu>
#include <QSaveFile>
#include <QSvgGenerator>
#include <QTableWidget>

#include "qcustomplot_include.h"

namespace hh::workbench {

namespace {

bool fail(QString* error, const QString& why) {
  if (error) *error = why;
  return false;
}

QString csvCell(QString s) {
  if (s.contains(QLatin1Char(',')) || s.contains(QLatin1Char('"')) || s.contains(QLatin1Char('\n'))) {
    s.replace(QLatin1String("\""), QLatin1String("\"\""));
    return QLatin1Char('"') + s + QLatin1Char('"');
  }
  return s;
}

}  // namespace

bool exportPlot(QCustomPlot* plot, const QString& file, QString* error) {
  const QString suffix = QFileInfo(file).suffix().toLower();
  const int w = plot->width(), h = plot->height();
  // Rendered into a temporary file beside the target, then renamed over it.
  const QString tmp = file + QStringLiteral(".tmp-export.") + suffix;
  bool ok = false;
  if (suffix == QLatin1String("png")) {
    ok = plot->savePng(tmp, w, h, 2.0);
  } else if (suffix == QLatin1String("pdf")) {
    ok = plot->savePdf(tmp, w, h);
  } else if (suffix == QLatin1String("svg")) {
    QSvgGenerator gen;
    gen.setFileName(tmp);
    gen.setSize(QSize(w, h));
    gen.setViewBox(QRect(0, 0, w, h));
    gen.setTitle(plot->objectName());
    QCPPainter painter;
    ok = painter.begin(&gen);
    if (ok) {
      plot->toPainter(&painter, w, h);
      painter.end();
    }
  } else {
    return fail(error, QStringLiteral("%1: choose a .png, .svg or .pdf file").arg(file));
  }
  if (!ok || !QFileInfo(tmp).exists()) {
    QFile::remove(tmp);
    return fail(error, QStringLiteral("%1: cannot be written").arg(file));
  }
  QFile::remove(file);
  if (!QFile::rename(tmp, file)) {
    QFile::remove(tmp);
    return fail(error, QStringLiteral("%1: cannot be written").arg(file));
  }
  return true;
}

bool exportTableCsv(const QTableWidget* table, const QString& file, QString* error) {
  QString text;
  QStringList header;
  for (int c = 0; c < table->columnCount(); ++c) {
    const QTableWidgetItem* item = table->horizontalHeaderItem(c);
    header << csvCell(item ? item->text() : QString());
  }
  text += header.join(QLatin1Char(',')) + QLatin1Char('\n');
  for (int r = 0; r < table->rowCount(); ++r) {
    QStringList row;
    for (int c = 0; c < table->columnCount(); ++c) {
      const QTableWidgetItem* item = table->item(r, c);
      row << csvCell(item ? item->text() : QString());
    }
    text += row.join(QLatin1Char(',')) + QLatin1Char('\n');
  }
  QSaveFile out(file);
  if (!out.open(QIODevice::WriteOnly) || out.write(text.toUtf8()) < 0 || !out.commit())
    return fail(error, QStringLiteral("%1: cannot be written (%2)").arg(file, out.errorString()));
  return true;
}

void addExportMenu(QCustomPlot* plot) {
  plot->setContextMenuPolicy(Qt::CustomContextMenu);
  QObject::connect(plot, &QWidget::customContextMenuRequested, plot, [plot](const QPoint& pos) {
    QMenu menu(plot);
    menu.addAction(QObject::tr("Export as PNG, SVG or PDF\u2026"), plot, [plot] {
      const QString f = QFileDialog::getSaveFileName(plot, QObject::tr("Export Plot"), plot->objectName() + QStringLiteral(".png"),
                                                     QObject::tr("Images (*.png *.svg *.pdf)"));
      if (!f.isEmpty()) exportPlot(plot, f);
    });
    menu.exec(plot->mapToGlobal(pos));
  });
}

void addExportMenu(QTableWidget* table) {
  table->setContextMenuPolicy(Qt::CustomContextMenu);
  QObject::connect(table, &QWidget::customContextMenuRequested, table, [table](const QPoint& pos) {
    QMenu menu(table);
    menu.addAction(QObject::tr("Export as CSV\u2026"), table, [table] {
      const QString f = QFileDialog::getSaveFileName(table, QObject::tr("Export Table"), table->objectName() + QStringLiteral(".csv"),
                                                     QObject::tr("CSV (*.csv)"));
      if (!f.isEmpty()) exportTableCsv(table, f);
    });
    menu.exec(table->viewport()->mapToGlobal(pos));
  });
}

}  // namespace hh::workbench
