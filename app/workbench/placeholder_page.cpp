#include "placeholder_page.h"

#include <QLabel>
#include <QVBoxLayout>

namespace hh::workbench {

PlaceholderPage::PlaceholderPage(const QString& title, const QString& description, QWidget* parent)
    : QWidget(parent), title_(title) {
  auto* heading = new QLabel(title, this);
  QFont f = heading->font();
  f.setPointSizeF(f.pointSizeF() * 1.4);
  f.setBold(true);
  heading->setFont(f);

  auto* status = new QLabel(tr("Not available in this version yet."), this);
  QFont italic = status->font();
  italic.setItalic(true);
  status->setFont(italic);

  auto* text = new QLabel(description, this);
  text->setObjectName(QStringLiteral("placeholderDescription"));
  text->setWordWrap(true);
  text->setMaximumWidth(620);
  text->setTextInteractionFlags(Qt::TextSelectableByMouse);
  QPalette p = text->palette();
  p.setColor(QPalette::WindowText, p.color(QPalette::Disabled, QPalette::WindowText));
  text->setPalette(p);
  status->setPalette(p);

  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(24, 20, 24, 20);
  layout->setSpacing(8);
  layout->addWidget(heading);
  layout->addWidget(status);
  layout->addSpacing(6);
  layout->addWidget(text);
  layout->addStretch(1);
}

}  // namespace hh::workbench
